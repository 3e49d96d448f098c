"""What GPU clusters need in an engine pod, rendered (the real API server admits these pods in
tests/k8s/test_crd_bounds.py): per-role image, GPUs, resources, placement and arguments; env,
extra volumes, /dev/shm, runtime and priority class, pull secrets, labels, affinity; model
sources as users keep weights; rolling updates that never take a pool down at once."""

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

GPU_CLUSTER_ENGINE: dict[str, Any] = {
    "image": "epd-engine:0.2.0-cuda",
    "shmSize": "16Gi",
    "runtimeClassName": "nvidia",
    "priorityClassName": "inference-high",
    "imagePullSecrets": [{"name": "registry"}],
    "env": [
        {"name": "NCCL_DEBUG", "value": "WARN"},
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
        {"name": "HOME", "value": "/cache"},
    ],
    "envFrom": [{"configMapRef": {"name": "nccl-settings"}, "prefix": "X_"}],
    "volumes": [{"name": "jit-cache", "persistentVolumeClaim": {"claimName": "flashinfer-jit"}}],
    "volumeMounts": [{"name": "jit-cache", "mountPath": "/cache", "readOnly": False}],
    "podLabels": {"team": "vision"},
    "podAnnotations": {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"},
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}
                ]
            }
        }
    },
    "topologySpreadConstraints": [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "DoNotSchedule",
        }
    ],
    "terminationGracePeriodSeconds": 120,
    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
    "resources": {"requests": {"cpu": "8", "memory": "64Gi"}},
    "extraArgs": ["--max-num-running", "128"],
    "roles": {
        "E": {
            "image": "epd-engine:0.2.0-cuda-small",
            "gpuResourceName": "nvidia.com/mig-3g.40gb",
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-L4"},
            "tolerations": [{"key": "tier", "operator": "Equal", "value": "l4"}],
            "resources": {"requests": {"cpu": "4"}},
            "extraArgs": ["--max-num-running", "32"],
        }
    },
}


def _pods(owner: Owner, plan: Plan = PLAN) -> dict[Role, dict[str, Any]]:
    return {
        pool.role: r.render_pool_deployment(owner, pool, plan) for pool in r.pool_specs(owner, plan)
    }


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


def test_pods_carry_env_volumes_shm_runtime_class_and_pass_through_objects() -> None:
    owner = make_owner(engine=GPU_CLUSTER_ENGINE)
    dep = _pods(owner)[Role.P]
    template = dep["spec"]["template"]
    pod = template["spec"]
    container = _container(dep)
    env = {e["name"]: e for e in container["env"]}
    assert env["NCCL_DEBUG"] == {"name": "NCCL_DEBUG", "value": "WARN"}
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert env["HOME"] == {"name": "HOME", "value": "/cache"}  # the spec's replaces ours
    assert [e["name"] for e in container["env"]].count("HOME") == 1
    assert {"EPD_INTERNAL_TOKEN", "EPD_DEPLOYMENT_ID", "POD_IP", "POD_NAME"} <= set(env)
    assert container["envFrom"] == [{"configMapRef": {"name": "nccl-settings"}, "prefix": "X_"}]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["shm"] == {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}
    assert volumes["jit-cache"] == {
        "name": "jit-cache",
        "persistentVolumeClaim": {"claimName": "flashinfer-jit"},
    }
    assert {"name": "jit-cache", "mountPath": "/cache"} in container["volumeMounts"]
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["priorityClassName"] == "inference-high"
    assert pod["imagePullSecrets"] == [{"name": "registry"}]
    # the spec's affinity whole, with the preference for D's nodes beside it (P's partners:
    # E's L4 selector excludes the H100 nodes; tests/operator/test_partner_affinity.py)
    assert pod["affinity"]["nodeAffinity"] == GPU_CLUSTER_ENGINE["affinity"]["nodeAffinity"]
    assert pod["topologySpreadConstraints"] == GPU_CLUSTER_ENGINE["topologySpreadConstraints"]
    assert pod["terminationGracePeriodSeconds"] == 120
    assert template["metadata"]["labels"]["team"] == "vision"
    assert template["metadata"]["labels"][r.LABEL_POOL] == dep["metadata"]["name"]
    annotations = template["metadata"]["annotations"]
    assert annotations["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false"
    assert annotations["prometheus.io/scrape"] == "true"
    # the router runs the engine image: it pulls with the same secrets
    router_pod = r.render_router_deployment(owner)["spec"]["template"]["spec"]
    assert router_pod["imagePullSecrets"] == [{"name": "registry"}]


def test_roles_get_their_own_image_gpus_resources_placement_and_args() -> None:
    owner = make_owner(engine=GPU_CLUSTER_ENGINE)
    pods = _pods(owner)
    encoder, prefill = _container(pods[Role.E]), _container(pods[Role.P])
    assert encoder["image"] == "epd-engine:0.2.0-cuda-small"
    assert prefill["image"] == "epd-engine:0.2.0-cuda"
    assert encoder["resources"]["limits"] == {"nvidia.com/mig-3g.40gb": "1"}
    assert encoder["resources"]["requests"] == {
        "cpu": "4",  # the role's, per name over the engine's
        "memory": "64Gi",
        "nvidia.com/mig-3g.40gb": "1",
    }
    assert prefill["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    e_pod, p_pod = (
        pods[Role.E]["spec"]["template"]["spec"],
        pods[Role.P]["spec"]["template"]["spec"],
    )
    assert e_pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-L4"}  # replaces
    assert e_pod["tolerations"] == [{"key": "tier", "value": "l4"}]
    assert p_pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert "tolerations" not in p_pod
    parser = build_parser()
    assert parser.parse_args(encoder["args"]).max_num_running == 32  # appended: the last wins
    assert parser.parse_args(prefill["args"]).max_num_running == 128
    for role, dep in pods.items():
        gpus = dep["metadata"]["annotations"][r.ANNOTATION_GPUS]
        assert gpus == "1", role


def test_a_role_on_cpu_requests_no_gpu_and_the_budget_counts_it() -> None:
    owner = make_owner(gpuBudget=3, engine={"roles": {"E": {"gpusPerInstance": 0}}})
    pools = {p.role: p for p in r.pool_specs(owner, PLAN)}
    assert (pools[Role.E].gpus, pools[Role.P].gpus, pools[Role.D].gpus) == (0, 2, 1)
    encoder = _container(r.render_pool_deployment(owner, pools[Role.E], PLAN))
    assert "nvidia.com/gpu" not in str(encoder["resources"])
    assert encoder["args"][encoder["args"].index("--device") + 1] == "cpu"
    with pytest.raises(ValidationError, match="the fixed pools need 4 GPUs"):
        EPDDeploymentSpec.model_validate(make_spec_dict(gpuBudget=3))


def test_template_changes_keep_pool_names_and_identity_changes_make_new_pools() -> None:
    """Names carry what instances of one pool must share; the rest rolls within the pool."""
    base = {p.role: p.name for p in r.pool_specs(make_owner(), PLAN)}
    encoders_elsewhere = {"E": {**GPU_CLUSTER_ENGINE["roles"]["E"], "gpuResourceName": None}}
    same = [
        {"engine": {"image": "epd-engine:0.2.0"}},
        {"engine": {**GPU_CLUSTER_ENGINE, "roles": encoders_elsewhere}},
        {"router": {"replicas": 2, "port": 9000}},
    ]
    for overrides in same:
        names = {p.role: p.name for p in r.pool_specs(make_owner(**overrides), PLAN)}
        assert names == base, overrides
    new = [
        ({"engine": {"kvBlockSize": 32}}, {Role.E, Role.P, Role.D}),
        ({"engine": {"transferBackend": "tcp"}}, {Role.E, Role.P, Role.D}),
        ({"engine": {"roles": {"E": {"gpusPerInstance": 0}}}}, {Role.E}),
        ({"engine": {"roles": {"D": {"gpuResourceName": "amd.com/gpu"}}}}, {Role.D}),
        ({"gpuResourceName": "amd.com/gpu"}, {Role.E, Role.P, Role.D}),
    ]
    for overrides, changed in new:
        names = {p.role: p.name for p in r.pool_specs(make_owner(**overrides), PLAN)}
        assert {role for role in names if names[role] != base[role]} == changed, overrides


def test_template_changes_roll_replica_by_replica_within_the_budget() -> None:
    """Never Recreate: surge one while gpuBudget has room for it, else drain one at a time;
    a one-instance pool surges anyway (a stage with nobody serving is worse)."""

    def strategies(owner: Owner) -> dict[Role, dict[str, int]]:
        out = {}
        for role, dep in _pods(owner).items():
            strategy = dep["spec"]["strategy"]
            assert strategy["type"] == "RollingUpdate"
            out[role] = strategy["rollingUpdate"]
        return out

    surge, drain = {"maxSurge": 1, "maxUnavailable": 0}, {"maxSurge": 0, "maxUnavailable": 1}
    roomy = strategies(make_owner(gpuBudget=8))  # 4 in use, 3 pools: room for each
    assert roomy == {Role.E: surge, Role.P: surge, Role.D: surge}
    tight = strategies(make_owner(gpuBudget=5))  # room for one: E takes it, P drains one
    assert tight == {Role.E: surge, Role.P: drain, Role.D: surge}
    cpu = strategies(make_owner(gpuBudget=4, engine={"gpusPerInstance": 0}))
    assert cpu == {Role.E: surge, Role.P: surge, Role.D: surge}


def test_model_sources_as_users_keep_weights() -> None:
    """A PVC mounts read-only (a ReadOnlyMany claim), a Hugging Face cache is mounted whole
    (its snapshot files are symlinks into ../../blobs), hostPath stays a Directory."""
    pvc = make_owner(model={"name": "m", "source": {"pvc": {"claimName": "w", "path": "ckpt"}}})
    pod = _pods(pvc)[Role.P]["spec"]["template"]["spec"]
    assert pod["volumes"][0] == {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "w", "readOnly": True},
    }
    hf = {"repo": "llava-hf/llava-1.5-7b-hf", "revision": "main"}
    cache = make_owner(
        model={
            "name": "m",
            "source": {"pvc": {"claimName": "hf", "path": "hub"}, "huggingFaceCache": hf},
        }
    )
    container = _container(_pods(cache)[Role.P])
    assert container["volumeMounts"][0] == {
        "name": "model",
        "mountPath": "/models/m",
        "readOnly": True,
    }
    model = container["args"][container["args"].index("--model") + 1]
    assert model == "/models/m/hub/models--llava-hf--llava-1.5-7b-hf/snapshots/main"
    host = make_owner(
        model={"name": "m", "source": {"hostPath": {"path": "/data/hf"}, "huggingFaceCache": hf}}
    )
    container = _container(_pods(host)[Role.P])
    pod = _pods(host)[Role.P]["spec"]["template"]["spec"]
    assert pod["volumes"][0]["hostPath"] == {"path": "/data/hf", "type": "Directory"}
    model = container["args"][container["args"].index("--model") + 1]
    assert model == "/models/m/models--llava-hf--llava-1.5-7b-hf/snapshots/main"


def test_terminating_engines_drain_within_the_grace_period(owner: Owner) -> None:
    dep = _pods(owner)[Role.D]
    container = _container(dep)
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 60
    args = build_parser().parse_args(container["args"])
    assert args.drain_timeout == 50  # leaves 10 s to shut down before SIGKILL


def test_a_toleration_of_a_lost_node_is_rendered_with_its_seconds() -> None:
    """``tolerationSeconds`` (NoExecute) shortens how long a pool stays on a node that stopped
    reporting before it is evicted and started elsewhere (300 s by default)."""
    unreachable = {"key": "node.kubernetes.io/unreachable", "operator": "Exists",
                   "effect": "NoExecute", "tolerationSeconds": 30}  # fmt: skip
    owner = make_owner(engine={"roles": {"D": {"tolerations": [unreachable]}}})
    decode = _pods(owner)[Role.D]["spec"]["template"]["spec"]
    assert decode["tolerations"] == [unreachable]
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        make_owner(engine={"tolerations": [{**unreachable, "tolerationSeconds": -1}]})
