"""Emulated engine pods (``spec.engine.emulate``), rendered: every pool runs ``epdctl serve
--emulate`` timed by the profiler's cost model (mounted from its ConfigMap) or the built-in
reference, with no GPU, no weights and the CPU image; the router answers to the emulated
name; real and emulated instances never share a pool. The real API server admits these pods
and the real node runs them in ``tests/k8s/test_real_emulated_pods.py``."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from epd_engine.cli import build_parser
from epd_engine.config import Method, Role
from epd_engine.contracts.plan import Plan
from epd_operator.api.spec import EPDDeploymentSpec
from epd_operator.kube import manifests as r
from epd_operator.kube.manifests import Owner
from tests.operator.conftest import make_owner, make_spec_dict

PLAN = Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 2, Role.D: 1})
COST_MODEL = {"costModel": {"configMapName": "h200-costs", "key": "cost.json"}}


def _containers(owner: Owner) -> dict[Role, dict[str, Any]]:
    return {
        pool.role: r.render_pool_deployment(owner, pool, PLAN)["spec"]["template"]["spec"]
        for pool in r.pool_specs(owner, PLAN)
    }


def test_every_pool_runs_emulated_instances_timed_by_the_profilers_cost_model() -> None:
    owner = make_owner(engine={"emulate": True}, profiler=COST_MODEL)
    for role, pod in _containers(owner).items():
        [container] = pod["containers"]
        args = build_parser().parse_args(container["args"])  # epdctl takes them
        assert args.emulate == "/etc/epd/cost-model/cost.json"
        assert str(args.model) == "llava"  # a name to serve under, not a checkpoint
        assert args.device == "cpu" and args.role == role.value
        assert "--preset" not in container["args"]  # nothing to make: no weights
        assert container["image"] == "epd-engine:0.1.0"  # the CPU image (gpusPerInstance 1)
        resources = container["resources"]
        assert not any("gpu" in name for name in resources["requests"])
        assert resources["requests"] == {"cpu": "100m", "memory": "128Mi"}
        assert resources["limits"] == {"memory": "512Mi"}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert "model" not in volumes
        assert volumes["cost-model"] == {"name": "cost-model", "configMap": {"name": "h200-costs"}}
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["cost-model"] == {
            "name": "cost-model",
            "mountPath": "/etc/epd/cost-model",
            "readOnly": True,
        }
        assert "model" not in mounts
    assert r.router_config(owner, PLAN, [])["model"] == "llava-emulated"


def test_without_a_cost_model_the_built_in_reference_times_them() -> None:
    owner = make_owner(engine={"emulate": True})
    for pod in _containers(owner).values():
        [container] = pod["containers"]
        assert build_parser().parse_args(container["args"]).emulate == "reference"
        assert all(v["name"] != "cost-model" for v in pod["volumes"])


def test_a_spec_resource_or_image_still_wins() -> None:
    engine = {"emulate": True, "image": "epd-engine:dev", "resources": {"requests": {"cpu": "1"}}}
    pod = _containers(make_owner(engine=engine))[Role.P]
    [container] = pod["containers"]
    assert container["image"] == "epd-engine:dev"
    assert container["resources"]["requests"] == {"cpu": "1", "memory": "128Mi"}


def test_a_roles_own_image_wins_and_the_others_default_to_the_cpu_image() -> None:
    """One image rule for real and emulated pods (``role_pod``): a role's own image, then the
    engine's, then the default for its GPUs, none when emulated."""
    engine = {"emulate": True, "roles": {"E": {"image": "enc:1"}}}
    pods = _containers(make_owner(engine=engine))
    assert pods[Role.E]["containers"][0]["image"] == "enc:1"
    assert pods[Role.P]["containers"][0]["image"] == "epd-engine:0.1.0"


def test_real_and_emulated_instances_never_share_a_pool() -> None:
    real = {p.role: p.name for p in r.pool_specs(make_owner(), PLAN)}
    emulated = {p.role: p.name for p in r.pool_specs(make_owner(engine={"emulate": True}), PLAN)}
    assert all(real[role] != emulated[role] for role in real)
    assert r.router_config(make_owner(), PLAN, [])["model"] == "llava"  # unchanged when real


def test_placement_groups_are_not_emulated() -> None:
    spec = make_spec_dict(engine={"emulate": True}, placement={"mode": "Groups"})
    with pytest.raises(ValidationError, match=r"engine\.emulate runs each instance as its own"):
        EPDDeploymentSpec.model_validate(spec)
