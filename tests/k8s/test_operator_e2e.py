"""End to end against a real API server: helm install, apply, roll out, reject, degrade, delete.

Pods land on kwok's fake GPU nodes and become Running/Ready without containers. The router
pods never run, so a real router process on loopback stands in for them (``LoopbackRouter``):
the operator switches it, reads it back and drains by its in-flight counts.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import yaml

from tests.k8s.conftest import ROOT, Cluster, LoopbackRouter, wait_until

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.usefixtures("operator")]

EXAMPLE = ROOT / "examples" / "k8s" / "epd-fixed-e-p-d.yaml"
NAME = "llava"


def condition(obj: dict | None, ctype: str) -> dict[str, Any]:
    for c in ((obj or {}).get("status") or {}).get("conditions", []):
        if c["type"] == ctype:
            return c
    return {}


def epd(cluster: Cluster, ns: str, name: str = NAME) -> dict | None:
    return cluster.get("epddeployment", name, "-n", ns)


def engine_deployments(cluster: Cluster, ns: str) -> dict[str, dict]:
    items = cluster.items("deployments", "-n", ns, "-l", "app.kubernetes.io/component=engine")
    return {d["metadata"]["name"]: d for d in items if not d["metadata"].get("deletionTimestamp")}


def models_volume(cluster: Cluster, ns: str) -> None:
    """The example reads weights from PVC `models`: back it with a hostPath PV."""
    docs = [
        {"apiVersion": "v1", "kind": "PersistentVolume",
         "metadata": {"name": f"models-{ns}"},
         "spec": {"capacity": {"storage": "100Gi"}, "accessModes": ["ReadOnlyMany"],
                  "storageClassName": "manual", "hostPath": {"path": "/mnt/models"},
                  "claimRef": {"namespace": ns, "name": "models"}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
         "metadata": {"name": "models", "namespace": ns},
         "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "manual",
                  "resources": {"requests": {"storage": "100Gi"}}}},
    ]  # fmt: skip
    # a PV left Released by an earlier run (reused cluster) would never bind again
    cluster.kubectl("delete", "pv", f"models-{ns}", "--ignore-not-found", "--timeout=60s")
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(docs))


def wait_ready(cluster: Cluster, ns: str, timeout_s: float = 180) -> dict:
    def ready() -> dict | None:
        obj = epd(cluster, ns)
        done = (
            condition(obj, "Ready").get("status") == "True"
            and condition(obj, "Progressing").get("status") == "False"
            and condition(obj, "Ready").get("observedGeneration")
            == (obj or {})["metadata"]["generation"]
        )
        return obj if done else None

    return wait_until("EPDDeployment Ready and not Progressing", ready, timeout_s)


def observe_rollout(
    cluster: Cluster, ns: str, old_pools: set[str], patch: dict[str, Any]
) -> list[dict[str, Any]]:
    """Apply ``patch`` and poll (pools, status, pools) until the rollout completes. Each
    snapshot brackets the status read between two listings, so the checks hold whatever
    happens in between. Clients are ready before the patch: the first snapshot is immediate."""
    from kubernetes import client

    api = cluster.api_client()
    apps, custom = client.AppsV1Api(api), client.CustomObjectsApi(api)
    group = ("epd.serving.dev", "v1alpha1", ns, "epddeployments", NAME)

    def pools() -> dict[str, bool]:
        deps = apps.list_namespaced_deployment(
            ns, label_selector="app.kubernetes.io/component=engine"
        )
        # serving: a Ready pod (a pool resized in place serves while it grows)
        return {
            d.metadata.name: (d.status.ready_replicas or 0) >= min(1, d.spec.replicas)
            for d in deps.items
            if d.metadata.deletion_timestamp is None
        }

    pools()  # warm the connection
    custom.patch_namespaced_custom_object(*group, patch)  # dict body: JSON merge patch
    snapshots: list[dict[str, Any]] = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        before = pools()
        obj = custom.get_namespaced_custom_object(*group)
        after = pools()
        snap = {
            "pools_before": before,
            "pools_after": after,
            "active": set(obj["status"].get("activePools", [])),
            "progressing": condition(obj, "Progressing").get("reason"),
            "generation_seen": condition(obj, "Ready").get("observedGeneration"),
            "generation": obj["metadata"]["generation"],
        }
        snapshots.append(snap)
        # Stop once even the listing *before* the status read lacks the old pools: stopping on
        # the one after left no snapshot that saw them gone whenever they went between the
        # two listings of the last one (the ordering check below then had nothing to find).
        if (
            snap["generation_seen"] == snap["generation"]
            and snap["progressing"] == "RolloutComplete"
            and set(before).isdisjoint(old_pools)
        ):
            break
        time.sleep(0.1)
    api.close()
    return snapshots


def test_crd_is_established_with_short_name_and_columns(cluster: Cluster) -> None:
    crd = cluster.get("crd", "epddeployments.epd.serving.dev")
    assert crd["spec"]["names"]["shortNames"] == ["epd"]
    assert condition(crd, "Established")["status"] == "True"
    columns = [c["name"] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]]
    assert columns == ["Method", "Pools", "Ready", "Goodput", "Age"]


@pytest.mark.parametrize(
    ("mutate", "field", "words"),
    [
        (lambda s: s.update(gpuBudget=-2), "spec.gpuBudget", "greater than or equal to 1"),
        (lambda s: s["disaggregation"].update(method="E+X"), "spec.disaggregation.method",
         'Unsupported value: "E+X"'),
        (lambda s: s.pop("model"), "spec.model", "Required value"),
        (lambda s: s["disaggregation"].update(pools={"E": 4, "P": 4, "D": 4}), "spec.gpuBudget",
         "more GPUs"),
        (lambda s: s["disaggregation"].update(method="EP+D"), "spec.disaggregation.pools",
         "exactly the roles of the method"),
    ],
    ids=["negative-budget", "unknown-method", "missing-model", "over-budget", "pools-vs-method"],
)  # fmt: skip
def test_invalid_manifests_are_rejected_naming_the_field(
    cluster: Cluster, namespace: str, mutate: Any, field: str, words: str
) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    mutate(doc["spec"])
    proc = cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(doc), check=False
    )
    assert proc.returncode != 0, proc.stdout
    assert field in proc.stderr and words in proc.stderr, proc.stderr
    assert epd(cluster, namespace) is None


def test_fixed_plan_rollout_and_safe_plan_change(
    cluster: Cluster, namespace: str, loopback_router: LoopbackRouter
) -> None:
    ns = namespace
    models_volume(cluster, ns)
    cluster.kubectl("apply", "-n", ns, "-f", str(EXAMPLE))
    loopback_router.serve(cluster, ns, NAME)

    # --- E+P+D 1E2P1D: pools, GPU requests, pods Running on GPU nodes, Ready ----------------
    obj = wait_ready(cluster, ns)
    status = obj["status"]
    assert (status["plan"]["method"], status["plan"]["summary"]) == ("E+P+D", "1E2P1D")
    assert status["readyPools"] == "3/3"
    deps = engine_deployments(cluster, ns)
    by_role = {d["metadata"]["labels"]["epd.serving.dev/role"]: d for d in deps.values()}
    assert {r: d["spec"]["replicas"] for r, d in by_role.items()} == {"E": 1, "P": 2, "D": 1}
    for dep in deps.values():
        limits = dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "1"
        assert dep["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
    # every pod proves membership of this EPDDeployment (not of an earlier one of its name)
    router_dep = cluster.get("deployment", f"{NAME}-router", "-n", ns)
    for dep in [*deps.values(), router_dep]:
        env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
        ids = [e.get("value") for e in env if e["name"] == "EPD_DEPLOYMENT_ID"]
        assert ids == [obj["metadata"]["uid"]], dep["metadata"]["name"]
    pods = cluster.items("pods", "-n", ns, "-l", "app.kubernetes.io/component=engine")
    assert len(pods) == 4
    for pod in pods:
        assert pod["status"]["phase"] == "Running"
        node = cluster.get("node", pod["spec"]["nodeName"])
        assert int(node["status"]["capacity"]["nvidia.com/gpu"]) >= 1
    assert set(status["activePools"]) == set(deps)
    children = [
        ("service", f"{NAME}-router"),
        ("configmap", f"{NAME}-config"),
        ("secret", f"{NAME}-internal-token"),
        ("deployment", f"{NAME}-router"),
    ]
    for kind, name in children:
        assert cluster.get(kind, name, "-n", ns) is not None, (kind, name)
    printed = cluster.kubectl("get", "epd", "-n", ns).stdout
    assert "E+P+D" in printed and "1E2P1D" in printed and "True" in printed

    # --- change to EP+D 2EP2D: observe the order of states ----------------------------------
    old_pools = set(deps)
    pools = {"E": None, "P": None, "EP": 2, "D": 2}  # merge patch: None removes E and P
    patch = {
        "spec": {
            "disaggregation": {"method": "EP+D", "pools": pools},
            "rollout": {"drainTimeoutSeconds": 3},
        }
    }
    snapshots = observe_rollout(cluster, ns, old_pools, patch)
    final = snapshots[-1]
    new_pools = set(final["pools_after"])
    assert final["progressing"] == "RolloutComplete", snapshots[-5:]
    # E and P go; the D pool is the same pool (same settings), resized 1 -> 2 in place
    [kept] = new_pools & old_pools
    assert kept.startswith(f"{NAME}-d-") and len(new_pools - old_pools) == 1, new_pools
    assert cluster.get("deployment", kept, "-n", ns)["spec"]["replicas"] == 2
    assert final["active"] == new_pools

    # 1) the router only ever routes to a complete plan whose pools exist and are Ready
    #    (in the listing taken just before or just after the status read)
    for snap in snapshots:
        assert snap["active"] in (old_pools, new_pools), snap
        ready = {p for p, ok in {**snap["pools_before"], **snap["pools_after"]}.items() if ok}
        assert snap["active"] <= ready, snap
    # 2) new pools existed next to the old ones before the switch
    switch = next(i for i, s in enumerate(snapshots) if s["active"] == new_pools)
    assert any(
        new_pools | old_pools <= set(s["pools_before"]) | set(s["pools_after"])
        for s in snapshots[: switch + 1]
    ), snapshots[: switch + 1]
    # 3) old pools were deleted only after the switch, after a Draining phase
    first_gone = next(i for i, s in enumerate(snapshots) if not old_pools <= set(s["pools_before"]))
    assert first_gone > switch
    assert "Draining" in [s["progressing"] for s in snapshots[switch:]]
    obj = wait_ready(cluster, ns)
    assert (obj["status"]["plan"]["method"], obj["status"]["plan"]["summary"]) == ("EP+D", "2EP2D")
    assert obj["status"]["plan"]["revision"] == 2
    reasons = {
        e["reason"]
        for e in cluster.items(
            "events", "-n", ns, "--field-selector", f"involvedObject.name={NAME}"
        )
    }
    assert {"PlanChanged", "Switched", "Drained"} <= reasons, reasons

    # --- delete: every child is garbage-collected -----------------------------------------------
    cluster.kubectl("delete", "epd", NAME, "-n", ns, "--wait=true", "--timeout=60s")

    def children_left() -> list[str]:
        left = []
        for kind in ("deployments", "replicasets", "pods", "services", "configmaps", "secrets"):
            items = cluster.items(kind, "-n", ns, "-l", "app.kubernetes.io/managed-by=epd-operator")
            left += [f"{kind}/{i['metadata']['name']}" for i in items]
        return left

    wait_until("garbage collection of every child", lambda: not children_left() or None, 180)


def test_more_gpus_than_the_nodes_have_is_degraded(
    cluster: Cluster, namespace: str, operator: Any
) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = "huge"
    doc["spec"]["model"]["source"] = {"preset": "tiny-llava"}
    doc["spec"]["gpuBudget"] = 32
    doc["spec"]["engine"]["gpusPerInstance"] = 1
    # 30 one-GPU instances; the kwok nodes have 24 GPUs in all (tools/cluster/nodes.sh)
    doc["spec"]["disaggregation"] = {"mode": "Fixed", "method": "EPD", "pools": {"EPD": 30}}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(doc))

    def degraded() -> dict | None:
        c = condition(epd(cluster, namespace, "huge"), "Degraded")
        return c if c.get("status") == "True" else None

    c = wait_until("Degraded condition", degraded, 120)
    assert c["reason"] == "InsufficientGPUs"
    assert "Insufficient nvidia.com/gpu" in c["message"]
    obj = epd(cluster, namespace, "huge")
    assert condition(obj, "Ready")["status"] == "False"
    assert operator.poll() is None, "the operator must keep running"
    cluster.kubectl("delete", "epd", "huge", "-n", namespace, "--wait=true", "--timeout=60s")


def test_budget_too_small_for_a_surge_goes_in_steps_serving_every_stage(
    cluster: Cluster, namespace: str, loopback_router: LoopbackRouter
) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = "tight"
    doc["spec"]["model"]["source"] = {"preset": "tiny-llava"}
    doc["spec"]["gpuBudget"] = 5
    doc["spec"]["rollout"]["drainTimeoutSeconds"] = 2
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(doc))
    loopback_router.serve(cluster, namespace, "tight")
    wait_until(
        "first plan Ready",
        lambda: condition(epd(cluster, namespace, "tight"), "Ready").get("status") == "True",
        180,
    )

    pools = {"E": None, "P": None, "EP": 2, "D": 1}  # 4 GPUs -> 3 GPUs; both at once need 7 > 5
    patch = {"spec": {"disaggregation": {"method": "EP+D", "pools": pools}}}
    cluster.kubectl(
        "patch", "epd", "tight", "-n", namespace, "--type", "merge", "-p", json.dumps(patch)
    )
    reasons, ready, max_gpus = set(), set(), 0
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        obj = epd(cluster, namespace, "tight") or {}
        reasons.add(condition(obj, "Progressing").get("reason"))
        ready.add(condition(obj, "Ready").get("status"))
        deps = engine_deployments(cluster, namespace)
        gpus = sum(
            d["spec"]["replicas"]
            * int(
                d["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][
                    "nvidia.com/gpu"
                ]
            )
            for d in deps.values()
        )
        max_gpus = max(max_gpus, gpus)
        done = condition(obj, "Progressing").get("reason") == "RolloutComplete"
        if done and obj["status"]["plan"]["method"] == "EP+D" and len(deps) == 2:
            break
        time.sleep(0.2)
    assert "SteppedRollout" in reasons, reasons
    assert max_gpus <= 5, "the GPU budget was exceeded during the rollout"
    assert ready == {"True"}, "Ready dropped during the stepped rollout"
    events = {
        e["reason"]
        for e in cluster.items(
            "events", "-n", namespace, "--field-selector", "involvedObject.name=tight"
        )
    }
    assert "SteppedRollout" in events, events
    cluster.kubectl("delete", "epd", "tight", "-n", namespace, "--wait=true", "--timeout=60s")


def test_auto_mode_starts_from_a_plan_within_the_budget(
    cluster: Cluster, namespace: str, loopback_router: LoopbackRouter
) -> None:
    cluster.kubectl(
        "apply", "-n", namespace, "-f", str(ROOT / "examples" / "k8s" / "epd-auto.yaml")
    )
    loopback_router.serve(cluster, namespace, "qwen2-vl")

    def planned() -> dict | None:
        obj = epd(cluster, namespace, "qwen2-vl")
        ready = condition(obj, "Ready").get("status") == "True"
        return obj if ready and condition(obj, "Progressing").get("status") == "False" else None

    obj = wait_until("Auto EPDDeployment Ready", planned, 180)
    plan = obj["status"]["plan"]
    gpus = sum(n for n in plan["pools"].values() if n)
    assert 1 <= gpus <= obj["spec"]["gpuBudget"]
    assert "no trace yet" in plan["reason"]
    assert len(engine_deployments(cluster, namespace)) == len(plan["method"].split("+"))
    cluster.kubectl("delete", "epd", "qwen2-vl", "-n", namespace, "--wait=true", "--timeout=60s")


def test_operator_log_has_no_tracebacks(operator: Any) -> None:
    log = (ROOT / ".build" / "test-logs" / "operator.log").read_text()
    assert "Traceback" not in log, log[-4000:]
