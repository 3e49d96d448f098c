"""spec.placement.mode Groups, rendered: each slice of the plan (one instance of every pool) is
one pod running `epdctl group` with a member per role, asking for the members' GPUs, CPU and
memory together; the instances left over stay in per-pool Deployments. The real API server
admits and schedules these pods in tests/k8s/test_group_pods.py."""

from __future__ import annotations

import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import pytest

from epd_engine.cli import build_parser
from epd_engine.config import Method, Role
from epd_engine.contracts.plan import Plan
from epd_operator.api.spec import EPDDeployment, EPDDeploymentSpec, ManifestError
from epd_operator.kube import manifests as r
from epd_operator.kube.group_pods import PROBE_SCRIPT
from epd_operator.kube.manifests import Owner
from tests.operator.conftest import make_owner, make_spec_dict

PLAN = Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 2, Role.D: 3})
GROUPS = {"mode": "Groups"}


def _grouped(**engine: Any) -> Owner:
    return make_owner(placement=GROUPS, engine={"gpusPerInstance": 1, **engine})


def _group_deployment(owner: Owner, plan: Plan = PLAN) -> dict[str, Any]:
    group = r.deployment_pools(owner, plan)[0]
    assert group.members
    return r.render_pool_deployment(owner, group, plan)


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(container)


def _members(container: dict[str, Any]) -> list[Any]:
    """Each ``--member`` parsed as ``epdctl`` parses a ``serve`` command line."""
    args = container["args"]
    assert args[0] == "group"
    texts = [args[i + 1] for i, a in enumerate(args) if a == "--member"]
    return [build_parser().parse_args(shlex.split(text)) for text in texts]


def test_a_slice_per_smallest_pool_and_the_rest_in_pools() -> None:
    owner = _grouped()
    pools = r.deployment_pools(owner, PLAN)
    group, *rest = pools
    assert (group.role, group.replicas, group.members) == (Role.EPD, 1, (Role.E, Role.P, Role.D))
    assert group.gpus_per_instance == 3 and group.name.startswith("demo-group-")
    assert [(p.role, p.replicas, p.members) for p in rest] == [(Role.P, 1, ()), (Role.D, 2, ())]
    # the plan's instances and GPUs, placed differently
    assert sum(p.gpus for p in pools) == sum(p.gpus for p in r.pool_specs(owner, PLAN)) == 6

    even = Plan(method=Method.EP_D, pools={Role.EP: 2, Role.D: 2})
    (only,) = r.deployment_pools(owner, even)
    assert (only.replicas, only.members, only.gpus_per_instance) == (2, (Role.EP, Role.D), 2)


def test_pools_mode_and_one_pool_plans_are_not_grouped() -> None:
    ungrouped = make_owner(engine={"gpusPerInstance": 1})
    assert r.deployment_pools(ungrouped, PLAN) == r.pool_specs(ungrouped, PLAN)
    auto = make_owner(placement=GROUPS, disaggregation={"mode": "Auto"})
    single = Plan(method=Method.EPD, pools={Role.EPD: 2})  # the profiler's choice
    assert r.deployment_pools(auto, single) == r.pool_specs(auto, single)


def test_group_name_follows_its_members_not_its_slice_count() -> None:
    """More slices resize the group pool in place (its name stays); changed members start a
    new one."""
    owner = _grouped()
    name = r.deployment_pools(owner, PLAN)[0].name
    assert r.deployment_pools(owner, PLAN)[0].name == name  # deterministic
    two = Plan(method=Method.E_P_D, pools={Role.E: 2, Role.P: 2, Role.D: 3})
    resized = r.deployment_pools(owner, two)[0]
    assert (resized.name, resized.replicas) == (name, 2)
    other_cache = _grouped(kvBlockSize=32)
    assert r.deployment_pools(other_cache, PLAN)[0].name != name


def test_group_pod_runs_one_member_per_role_on_its_own_port_and_gpu() -> None:
    owner = _grouped(roles={"E": {"gpusPerInstance": 0, "extraArgs": ["--max-num-running", "8"]}})
    deployment = _group_deployment(owner)
    group = r.deployment_pools(owner, PLAN)[0]
    container = _container(deployment)
    members = _members(container)
    assert [m.role for m in members] == ["E", "P", "D"]
    assert {m.pool for m in members} == {group.name}  # routed, drained, deleted as one pool
    assert [m.port for m in members] == [8000, 8001, 8002]
    assert [m.device for m in members] == ["cpu", "cuda:0", "cuda:1"]
    assert [m.instance_id for m in members] == ["$(POD_NAME)-e", "$(POD_NAME)-p", "$(POD_NAME)-d"]
    assert [m.advertise_url for m in members] == [
        f"http://$(POD_IP):{port}" for port in (8000, 8001, 8002)
    ]
    assert {m.transfer_backend for m in members} == {"auto"}
    assert members[0].max_num_running == 8  # a role's own arguments go to its member only
    assert container["ports"] == [
        {"name": f"http-{role}", "containerPort": port, "protocol": "TCP"}
        for role, port in (("e", 8000), ("p", 8001), ("d", 8002))
    ]
    assert container["image"] == "epd-engine-gpu:0.1.0"  # some member has a GPU
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels["epd.serving.dev/pool"] == group.name
    assert labels["epd.serving.dev/group-members"] == "E.P.D"
    assert deployment["metadata"]["annotations"]["epd.serving.dev/gpus-per-instance"] == "2"
    service = r.render_pool_service(owner, group)
    assert [(p["name"], p["port"]) for p in service["spec"]["ports"]] == [
        ("http-e", 8000),
        ("http-p", 8001),
        ("http-d", 8002),
    ]


def test_group_pod_asks_for_its_members_resources_together() -> None:
    owner = _grouped(
        resources={"requests": {"cpu": "4", "memory": "32Gi"}, "limits": {"memory": "48Gi"}},
        roles={"E": {"resources": {"requests": {"cpu": "500m"}}}},
    )
    resources = _container(_group_deployment(owner))["resources"]
    assert resources["requests"] == {"cpu": "8500m", "memory": "96Gi", "nvidia.com/gpu": "3"}
    assert resources["limits"] == {"memory": "144Gi", "nvidia.com/gpu": "3"}

    one_unlimited = _grouped(roles={"D": {"resources": {"limits": {"cpu": "2"}}}})
    resources = _container(_group_deployment(one_unlimited))["resources"]
    assert "cpu" not in resources["limits"]  # E and P have no CPU limit: none for the pod
    assert resources["requests"]["memory"] == "6Gi"  # three times the default 2Gi


def test_group_pod_keeps_what_every_engine_pod_gets() -> None:
    owner = _grouped(
        nodeSelector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        env=[{"name": "NCCL_DEBUG", "value": "WARN"}],
        runtimeClassName="nvidia",
        shmSize="16Gi",
    )
    pod = _group_deployment(owner)["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["runtimeClassName"] == "nvidia"
    assert "affinity" not in pod  # the cache partners are in the pod
    assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}} in pod["volumes"]
    container = pod["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "NCCL_DEBUG", "value": "WARN"} in container["env"]


def test_preset_members_make_their_checkpoints_apart() -> None:
    """Defect guarded: members sharing one preset directory would load files another member
    is still writing (serve makes the preset when config.json is missing)."""
    members = _members(_container(_group_deployment(_grouped())))
    assert [str(m.model) for m in members] == [
        "/models/llava/e",
        "/models/llava/p",
        "/models/llava/d",
    ]


@pytest.fixture
def members_health() -> Iterator[list[int]]:
    """Two health endpoints: the first Ready, the second not (503)."""
    servers = []
    for status in (200, 503):

        class Handler(BaseHTTPRequestHandler):
            code = status

            def do_GET(self) -> None:
                self.send_response(self.code)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        server = HTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    yield [s.server_address[1] for s in servers]
    for server in servers:
        server.shutdown()


def test_probe_fails_unless_every_member_answers(members_health: list[int]) -> None:
    ready, not_ready = members_health

    def probe(*ports: int) -> int:
        cmd = [sys.executable, "-c", PROBE_SCRIPT, "/health/ready", *map(str, ports)]
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode

    assert probe(ready) == 0
    assert probe(ready, not_ready) != 0
    assert probe(ready, 1) != 0  # nobody listening


def test_rollout_and_router_see_the_group_pool() -> None:
    owner = _grouped()
    group = r.deployment_pools(owner, PLAN)[0]
    names = r.router_config(owner, PLAN, [])["plan"]["pool_names"]
    assert names["group"] == group.name and set(names) == {"group", "P", "D"}
    strategy = _group_deployment(owner)["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate"


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (
            {"disaggregation": {"mode": "Fixed", "method": "EPD", "pools": {"EPD": 2}}},
            "method EPD has one pool",
        ),
        ({"engine": {"transferBackend": "tcp"}}, "needs engine.transferBackend auto, not tcp"),
        (
            {"engine": {"roles": {"E": {"nodeSelector": {"tier": "l4"}}}}},
            "engine.roles.E may not set nodeSelector",
        ),
        (
            {"engine": {"roles": {"D": {"image": "x", "tolerations": []}}}},
            "engine.roles.D may not set image, tolerations",
        ),
    ],
    ids=["one-pool-method", "transfer-backend", "role-node-selector", "role-image"],
)
def test_groups_refuse_what_one_pod_cannot_hold(overrides: dict[str, Any], words: str) -> None:
    doc: dict[str, Any] = {"apiVersion": "epd.serving.dev/v1alpha1", "kind": "EPDDeployment"}
    doc["spec"] = make_spec_dict(placement=GROUPS, **overrides)
    with pytest.raises(ManifestError, match=words):
        EPDDeployment.from_dict(doc)
    # the same spec without groups is fine
    EPDDeploymentSpec.model_validate(make_spec_dict(**overrides))
