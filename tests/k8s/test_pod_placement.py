"""Per-role placement with the real scheduler on kwok GPU nodes (no operator): the pools the
operator renders from examples/k8s/epd-gpu-2x8.yaml put encoders on the L4 nodes and prefill
and decode on the H100 nodes, each pod holding one GPU of its node's."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from tests.k8s.conftest import ROOT, Cluster, wait_until

pytestmark = pytest.mark.k8s

GPU_EXAMPLE = ROOT / "examples" / "k8s" / "epd-gpu-2x8.yaml"


def _weights_claim(cluster: Cluster, namespace: str) -> None:
    """The example's ReadOnlyMany claim, bound to a hostPath volume (kwok mounts nothing)."""
    volume = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": f"{namespace}-hf-cache"},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": "",
            "hostPath": {"path": "/tmp/epd-hf-cache"},
            "claimRef": {"namespace": namespace, "name": "hf-cache"},
        },
    }
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "hf-cache", "namespace": namespace},
        "spec": {
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": "",
            "volumeName": f"{namespace}-hf-cache",
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }
    for manifest in (volume, claim):
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps(manifest))


def test_roles_land_on_their_gpu_tier(cluster: Cluster, namespace: str) -> None:
    from epd_operator.api.spec import EPDDeployment, fixed_plan
    from epd_operator.kube import manifests as r

    doc: dict[str, Any] = yaml.safe_load(GPU_EXAMPLE.read_text())
    doc["spec"]["disaggregation"]["pools"] = {"E": 2, "P": 1, "D": 1}  # the shared kwok nodes
    dep = EPDDeployment.from_dict(doc)
    owner = r.Owner(name=dep.name, namespace=namespace, uid="uid-1", spec=dep.spec)
    plan = fixed_plan(dep.spec)
    _weights_claim(cluster, namespace)
    try:
        for pool in r.pool_specs(owner, plan):
            manifest = r.render_pool_deployment(owner, pool, plan)
            manifest["metadata"].pop("ownerReferences")  # no EPDDeployment object here
            cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=json.dumps(manifest))

        def scheduled() -> list[dict[str, Any]] | None:
            pods = cluster.items("pods", "-n", namespace)
            if len(pods) == 4 and all(p["spec"].get("nodeName") for p in pods):
                return pods
            return None

        pods = wait_until("the pools' pods scheduled", scheduled, timeout_s=90)
        nodes = {n["metadata"]["name"]: n for n in cluster.items("nodes")}
        placed: dict[str, set[str]] = {}
        for pod in pods:
            role = pod["metadata"]["labels"]["epd.serving.dev/role"]
            product = nodes[pod["spec"]["nodeName"]]["metadata"]["labels"]["nvidia.com/gpu.product"]
            placed.setdefault(role, set()).add(product)
            limits = pod["spec"]["containers"][0]["resources"]["limits"]
            assert limits["nvidia.com/gpu"] == "1", pod["metadata"]["name"]
        assert placed == {
            "E": {"NVIDIA-L4"},
            "P": {"NVIDIA-H100-80GB-HBM3"},
            "D": {"NVIDIA-H100-80GB-HBM3"},
        }
    finally:
        cluster.kubectl("delete", "pv", f"{namespace}-hf-cache", "--wait=false", check=False)
