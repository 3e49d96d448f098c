from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from epd_engine.cli import UserError
from epd_engine.config import Method, Role
from epd_engine.contracts.plan import Budgets, Plan
from epd_operator.kube import manifests as r
from epd_operator.kube.manifests import Owner
from tests.operator.conftest import make_owner

PLAN = Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 2, Role.D: 1})


def test_pool_names_are_deterministic_and_change_only_with_their_inputs(owner: Owner) -> None:
    first = r.pool_specs(owner, PLAN)
    assert [p.name for p in first] == [p.name for p in r.pool_specs(owner, PLAN)]
    assert [p.role for p in first] == [Role.E, Role.P, Role.D]
    assert all(p.name.startswith(f"demo-{p.role.value.lower()}-") for p in first)
    scaled = r.pool_specs(owner, Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 3, Role.D: 1}))
    # a count is not in the name: the P pool is resized in place
    assert [p.name for p in scaled] == [p.name for p in first]
    assert [p.replicas for p in scaled] == [1, 3, 1]
    other_budgets = Plan(
        method=Method.E_P_D,
        pools=PLAN.pools,
        budgets={Role.P: Budgets(token_budget=512, image_budget=2)},
    )
    assert r.pool_specs(owner, other_budgets)[1].name != first[1].name
    # the image is the pool's pod template (it rolls in place); the cache geometry is not
    other_image = make_owner(engine={"image": "epd-engine:0.2.0"})
    assert [p.name for p in r.pool_specs(other_image, PLAN)] == [p.name for p in first]
    other_pages = make_owner(engine={"kvBlockSize": 32})
    assert {p.name for p in r.pool_specs(other_pages, PLAN)}.isdisjoint({p.name for p in first})


def test_long_names_stay_within_dns_label_limits() -> None:
    long = Owner(name="x" * 60, namespace="ns", uid="u", spec=make_owner().spec)
    names = [p.name for p in r.pool_specs(long, PLAN)] + [r.router_name(long), r.secret_name(long)]
    assert all(len(n) <= 63 for n in names)


def test_pool_deployment_requests_gpus_and_probes_readiness(owner: Owner) -> None:
    pool = r.pool_specs(owner, PLAN)[1]
    dep = r.render_pool_deployment(owner, pool, PLAN)
    assert dep["metadata"]["name"] == pool.name
    assert dep["spec"]["replicas"] == 2
    assert dep["metadata"]["ownerReferences"] == [
        {"apiVersion": "epd.serving.dev/v1alpha1", "kind": "EPDDeployment", "name": "demo",
         "uid": "uid-1234", "controller": True, "blockOwnerDeletion": True}
    ]  # fmt: skip
    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
    args = container["args"]
    assert args[:2] == ["serve", "--model"]
    assert args[args.index("--role") + 1] == "P"
    assert args[args.index("--pool") + 1] == pool.name
    # every router replica by the headless Service's DNS, not one through the Service
    assert args[args.index("--router-url") + 1] == "http://demo-router-pods.serving.svc:8080"
    assert "--router-dns" in args
    assert args[-2:] == ["--preset", "tiny-llava"]
    selector = dep["spec"]["selector"]["matchLabels"]
    assert selector.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert r.ANNOTATION_HASH in dep["metadata"]["annotations"]


def test_each_replica_advertises_its_own_pod_address(owner: Owner) -> None:
    """Replicas of one pool must register distinct, reachable URLs: $(POD_IP)/$(POD_NAME)
    are expanded by Kubernetes only when the container env defines them."""
    for pool in r.pool_specs(owner, PLAN):
        container = r.render_pool_deployment(owner, pool, PLAN)["spec"]["template"]["spec"][
            "containers"
        ][0]
        args = container["args"]
        assert args[args.index("--advertise-url") + 1] == "http://$(POD_IP):8000"
        assert args[args.index("--instance-id") + 1] == "$(POD_NAME)"
        env = {e["name"]: e for e in container["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        referenced = set(re.findall(r"\$\((\w+)\)", " ".join(args)))
        assert referenced <= set(env), f"args use undefined env vars: {referenced - set(env)}"


def test_node_selector_tolerations_and_cpu_mode() -> None:
    owner = make_owner(
        engine={
            "gpusPerInstance": 0,
            "nodeSelector": {"pool": "cpu"},
            "tolerations": [{"key": "k", "operator": "Exists", "effect": "NoSchedule"}],
        }
    )
    pool = r.pool_specs(owner, PLAN)[0]
    pod = r.render_pool_deployment(owner, pool, PLAN)["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "cpu"}
    assert pod["tolerations"] == [{"key": "k", "operator": "Exists", "effect": "NoSchedule"}]
    container = pod["containers"][0]
    assert "nvidia.com/gpu" not in json.dumps(container.get("resources", {}))
    assert container["args"][container["args"].index("--device") + 1] == "cpu"


def test_router_pods_take_their_own_node_selector_and_tolerations() -> None:
    """Router pods had no placement of their own: a cluster whose CPU nodes are tainted could
    run the engines there but never the router."""
    owner = make_owner(
        router={
            "nodeSelector": {"pool": "cpu"},
            "tolerations": [{"key": "k", "operator": "Exists", "effect": "NoSchedule"}],
        }
    )
    pod = r.render_router_deployment(owner)["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "cpu"}
    assert pod["tolerations"] == [{"key": "k", "operator": "Exists", "effect": "NoSchedule"}]
    engine_pod = r.render_pool_deployment(owner, r.pool_specs(owner, PLAN)[0], PLAN)
    assert "nodeSelector" not in engine_pod["spec"]["template"]["spec"]


def test_model_sources_mount_read_only_weights() -> None:
    owner = make_owner(model={"name": "m", "source": {"pvc": {"claimName": "w", "path": "/ckpt"}}})
    pod = r.render_pool_deployment(owner, r.pool_specs(owner, PLAN)[0], PLAN)["spec"]["template"][
        "spec"
    ]
    claim = {"claimName": "w", "readOnly": True}  # a ReadOnlyMany claim attaches read-only
    assert pod["volumes"][0] == {"name": "model", "persistentVolumeClaim": claim}
    mount = pod["containers"][0]["volumeMounts"][0]
    assert mount == {"name": "model", "mountPath": "/models/m", "subPath": "ckpt", "readOnly": True}


def test_pool_service_is_headless(owner: Owner) -> None:
    pool = r.pool_specs(owner, PLAN)[0]
    svc = r.render_pool_service(owner, pool)
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"][r.LABEL_POOL] == pool.name


def test_router_and_configmap(owner: Owner) -> None:
    pools = r.pool_specs(owner, PLAN)
    cm = r.render_configmap(owner, PLAN, [pools[0].name])
    config = json.loads(cm["data"]["router.json"])
    assert config["active_pools"] == [pools[0].name]
    assert config["method"] == "E+P+D"
    assert list(config["plan"]["pool_names"]) == ["E", "P", "D"]
    assert (
        json.loads(r.render_configmap(owner, PLAN, [])["data"]["router.json"])["active_pools"]
        is None
    )
    assert Plan.model_validate_json(cm["data"]["plan.json"]) == PLAN
    dep = r.render_router_deployment(owner)
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["router", "--host", "0.0.0.0", "--port", "8080",
                                 "--config", "/etc/epd/router.json"]  # fmt: skip
    assert container["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "demo-internal-token"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    svc = r.render_router_service(owner)
    assert svc["spec"]["type"] == "ClusterIP" and svc["spec"]["ports"][0]["port"] == 8080
    pods = r.render_router_pods_service(owner)
    assert pods["metadata"]["name"] == "demo-router-pods"
    assert pods["spec"]["clusterIP"] == "None" and pods["spec"]["publishNotReadyAddresses"]
    assert pods["spec"]["selector"] == svc["spec"]["selector"]


def test_hash_changes_with_content(owner: Owner) -> None:
    a = r.render_configmap(owner, PLAN, [])
    b = r.render_configmap(owner, PLAN, ["x"])
    assert (
        a["metadata"]["annotations"][r.ANNOTATION_HASH]
        != b["metadata"]["annotations"][r.ANNOTATION_HASH]
    )
    assert a == r.render_configmap(owner, PLAN, [])


def test_pod_command_lines_parse_with_the_real_epdctl() -> None:
    """The engine and router args the operator renders are accepted by ``epdctl``'s parser."""
    from epd_engine.cli import build_parser

    owner = make_owner(engine={"kvBlockSize": 32, "numKvBlocks": 1024, "transferBackend": "nccl"})
    parser = build_parser()
    for pool in r.pool_specs(owner, PLAN):
        container = r.render_pool_deployment(owner, pool, PLAN)["spec"]["template"]["spec"][
            "containers"
        ][0]
        args = parser.parse_args(container["args"])
        assert (args.command, args.role, args.pool) == ("serve", pool.role.value, pool.name)
        assert args.kv_block_size == 32 and args.num_kv_blocks == 1024
        assert args.router_url == ["http://demo-router-pods.serving.svc:8080"]
        assert args.router_dns
        assert args.slo_tpot == 0.08
        assert args.transfer_backend == "nccl"
    router = r.render_router_deployment(owner)["spec"]["template"]["spec"]["containers"][0]
    args = parser.parse_args(router["args"])
    assert (args.command, args.port) == ("router", 8080)


def test_engine_refuses_a_gpu_transfer_backend_on_cpu(tmp_path: Path) -> None:
    """A GPU backend on CPU caches fails fast with a message naming what works."""
    from epd_engine.cli import build_parser
    from epd_engine.commands.serve import run

    args = build_parser().parse_args(
        ["serve", "--model", str(tmp_path), "--transfer-backend", "cuda_ipc"]
    )
    with pytest.raises(UserError, match="cuda_ipc backend moves CUDA caches and the device is cpu"):
        run(args)
