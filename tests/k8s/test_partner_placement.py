"""Cache partners land on one node, with the real scheduler on kwok GPU nodes (no operator):
the pools the operator renders for EP+D prefer each other's nodes (kube/partner_affinity.py),
so with two 8-GPU H100 nodes the decode pods join the node of the encode-prefill pod where
it has room, instead of spreading over both as one pool's replicas otherwise do."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.k8s.conftest import Cluster, wait_until

pytestmark = pytest.mark.k8s

H100 = "NVIDIA-H100-80GB-HBM3"
GPU = "nvidia.com/gpu"


def _spec(decoders: int) -> dict[str, Any]:
    return {
        "apiVersion": "epd.serving.dev/v1alpha1",
        "kind": "EPDDeployment",
        "metadata": {"name": "partners"},
        "spec": {
            "model": {"name": "llava", "source": {"preset": "tiny-llava"}},
            "gpuBudget": 1 + decoders,
            "gpuResourceName": GPU,
            "disaggregation": {
                "mode": "Fixed",
                "method": "EP+D",
                "pools": {"EP": 1, "D": decoders},
            },
            "engine": {
                "gpusPerInstance": 1,
                "nodeSelector": {"nvidia.com/gpu.product": H100},
                "tolerations": [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}],
            },
        },
    }


def _scheduled(cluster: Cluster, namespace: str, role: str, count: int) -> list[dict[str, Any]]:
    def ready() -> list[dict[str, Any]] | None:
        pods = cluster.items("pods", "-n", namespace, "-l", f"epd.serving.dev/role={role}")
        if len(pods) == count and all(p["spec"].get("nodeName") for p in pods):
            return pods
        return None

    pods: list[dict[str, Any]] = wait_until(f"{count} {role} pods scheduled", ready, timeout_s=90)
    return pods


def _free_gpus(cluster: Cluster, node: str) -> int:
    """GPUs of ``node`` no running or pending pod holds (other tests share the kwok nodes)."""
    allocatable = int(cluster.get("node", node)["status"]["allocatable"][GPU])
    pods = cluster.items("pods", "-A", "--field-selector", f"spec.nodeName={node}")
    used = sum(
        int(c.get("resources", {}).get("requests", {}).get(GPU, 0))
        for p in pods
        if p["status"].get("phase") not in ("Succeeded", "Failed")
        for c in p["spec"]["containers"]
    )
    return allocatable - used


def test_decoders_join_the_node_of_their_prefill_partner(cluster: Cluster, namespace: str) -> None:
    from epd_operator.api.spec import EPDDeployment, fixed_plan
    from epd_operator.kube import manifests as r

    decoders = 3
    dep = EPDDeployment.from_dict(_spec(decoders))
    owner = r.Owner(name=dep.name, namespace=namespace, uid="uid-1", spec=dep.spec)
    plan = fixed_plan(dep.spec)
    pools = {pool.role.value: pool for pool in r.pool_specs(owner, plan)}

    def apply(role: str) -> None:
        manifest = r.render_pool_deployment(owner, pools[role], plan)
        manifest["metadata"].pop("ownerReferences")  # no EPDDeployment object here
        cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=json.dumps(manifest))

    # the prefill side first, so the test does not depend on which pod the scheduler takes
    # first (either way the later pods are scored toward the earlier ones)
    apply("EP")
    (prefill,) = _scheduled(cluster, namespace, "EP", 1)
    node = prefill["spec"]["nodeName"]
    room = _free_gpus(cluster, node)
    apply("D")
    placed = [p["spec"]["nodeName"] for p in _scheduled(cluster, namespace, "D", decoders)]
    together = placed.count(node)
    assert together >= min(decoders, room), (node, room, placed)
    assert room < decoders or together == decoders, (node, room, placed)
