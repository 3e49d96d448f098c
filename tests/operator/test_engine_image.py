"""Which engine image a pod runs when the spec names none: the GPU variant (epd-engine-gpu:
FlashInfer with its kernels built in, CuPy, NVML) for instances with a GPU, the CPU one
otherwise and for the router (docker/engine.Dockerfile's two variants, api/images.py)."""

from __future__ import annotations

from typing import Any

from epd_engine.config import Method, Role
from epd_engine.contracts.plan import Plan
from epd_operator.api.images import ENGINE_IMAGE, GPU_ENGINE_IMAGE
from epd_operator.kube import manifests as r
from epd_operator.kube.manifests import Owner
from tests.operator.conftest import make_owner

PLAN = Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 2, Role.D: 1})


def _images(owner: Owner) -> dict[str, str]:
    """Image of each pool's engine container by role, and of the router."""
    out = {}
    for pool in r.pool_specs(owner, PLAN):
        pod = r.render_pool_deployment(owner, pool, PLAN)["spec"]["template"]["spec"]
        out[pool.role.value] = pod["containers"][0]["image"]
    router = r.render_router_deployment(owner)["spec"]["template"]["spec"]
    out["router"] = router["containers"][0]["image"]
    return out


def _owner(engine: dict[str, Any], router: dict[str, Any] | None = None) -> Owner:
    return make_owner(engine=engine, **({"router": router} if router else {}))


def test_gpu_instances_default_to_the_gpu_image_and_the_router_to_the_cpu_one() -> None:
    images = _images(make_owner())  # gpusPerInstance defaults to 1
    assert images == {"E": GPU_ENGINE_IMAGE, "P": GPU_ENGINE_IMAGE, "D": GPU_ENGINE_IMAGE,
                      "router": ENGINE_IMAGE}  # fmt: skip


def test_cpu_instances_default_to_the_cpu_image() -> None:
    images = _images(_owner({"gpusPerInstance": 0}))
    assert set(images.values()) == {ENGINE_IMAGE}


def test_a_role_on_cpu_gets_the_cpu_image_beside_gpu_roles() -> None:
    """Encoders moved to CPU (engine.roles.E.gpusPerInstance: 0) need no GPU stack."""
    images = _images(_owner({"roles": {"E": {"gpusPerInstance": 0}}}))
    assert images["E"] == ENGINE_IMAGE
    assert images["P"] == images["D"] == GPU_ENGINE_IMAGE
    role = make_owner(engine={"roles": {"E": {"gpusPerInstance": 0}}}).spec.engine
    assert role.role_pod(Role.E, "nvidia.com/gpu").image == ENGINE_IMAGE
    assert role.role_pod(Role.D, "nvidia.com/gpu").image == GPU_ENGINE_IMAGE


def test_a_named_image_wins_everywhere_and_the_router_follows_it() -> None:
    images = _images(_owner({"image": "registry.example/epd-engine-gpu:1.2"}))
    assert set(images.values()) == {"registry.example/epd-engine-gpu:1.2"}
    owner = _owner({"roles": {"E": {"image": "registry.example/enc:1"}}},
                   router={"image": "registry.example/router:1"})  # fmt: skip
    engine = owner.spec.engine
    assert engine.role_pod(Role.E, "nvidia.com/gpu").image == "registry.example/enc:1"
    assert engine.role_pod(Role.D, "nvidia.com/gpu").image == GPU_ENGINE_IMAGE
    assert _images(owner)["router"] == "registry.example/router:1"
