"""spec.placement.mode Groups against the real API server and scheduler on kwok GPU nodes: one
reconcile pass of the real controller renders a group pod per slice of the plan, which lands on
one H100 node holding the GPUs of all its members; and the CRD's rules refuse what one pod
cannot hold, naming the field."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from tests.k8s.conftest import Cluster, wait_until
from tests.k8s.reconcile_once import Pass

pytestmark = pytest.mark.k8s

H100 = "NVIDIA-H100-80GB-HBM3"
GPU = "nvidia.com/gpu"
NAME = "grouped"
SPEC: dict[str, Any] = {
    "apiVersion": "epd.serving.dev/v1alpha1",
    "kind": "EPDDeployment",
    "metadata": {"name": NAME},
    "spec": {
        "model": {"name": "llava", "source": {"preset": "tiny-llava"}},
        "gpuBudget": 3,
        "gpuResourceName": GPU,
        "placement": {"mode": "Groups"},
        "disaggregation": {"mode": "Fixed", "method": "EP+D", "pools": {"EP": 1, "D": 2}},
        "engine": {
            "gpusPerInstance": 1,
            "nodeSelector": {"nvidia.com/gpu.product": H100},
            "tolerations": [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}],
        },
    },
}


def _apply(cluster: Cluster, namespace: str, doc: dict[str, Any], check: bool = True) -> Any:
    return cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(doc), check=check
    )


def test_a_slice_runs_in_one_pod_on_one_gpu_node(
    cluster: Cluster, crd: None, namespace: str
) -> None:
    _apply(cluster, namespace, SPEC)
    status = Pass(cluster.api_client())(namespace, NAME)
    pools = {p["name"]: p for p in status["pools"]}
    group = next(name for name in pools if name.startswith(f"{NAME}-group-"))
    assert (pools[group]["role"], pools[group]["desired"], pools[group]["gpus"]) == ("EPD", 1, 2)
    assert [p["role"] for n, p in pools.items() if n != group] == ["D"]  # the D left over

    def scheduled() -> list[dict[str, Any]] | None:
        pods = cluster.items("pods", "-n", namespace, "-l", "app.kubernetes.io/component=engine")
        if len(pods) == 2 and all(p["spec"].get("nodeName") for p in pods):
            return pods
        return None

    pods = wait_until("the group pod and the D pod scheduled", scheduled, timeout_s=60)
    (pod,) = [p for p in pods if p["metadata"]["labels"]["epd.serving.dev/pool"] == group]
    assert pod["metadata"]["labels"]["epd.serving.dev/group-members"] == "EP.D"
    (container,) = pod["spec"]["containers"]
    assert container["args"][0] == "group" and container["args"].count("--member") == 2
    assert container["resources"]["limits"][GPU] == "2"
    node = cluster.get("node", pod["spec"]["nodeName"])
    assert node["metadata"]["labels"]["nvidia.com/gpu.product"] == H100


# (where in spec, the value, the field the API server names, words of its message)
REFUSED: list[tuple[str, Any, str, str]] = [
    (
        "disaggregation",
        {"mode": "Fixed", "method": "EPD", "pools": {"EPD": 2}},
        "spec.placement.mode",
        "method EPD has one pool",
    ),
    ("engine.transferBackend", "tcp", "spec.engine.transferBackend", "needs engine.transfer"),
    (
        "engine.roles",
        {"D": {"nodeSelector": {"tier": "l4"}}},
        "spec.engine.roles",
        "set image, gpuResourceName, nodeSelector and tolerations on engine",
    ),
]


def test_api_server_refuses_groups_one_pod_cannot_hold(
    cluster: Cluster, crd: None, namespace: str
) -> None:
    for path, value, field, words in REFUSED:  # one namespace for all: seconds each to make
        doc = copy.deepcopy(SPEC)
        *parents, leaf = path.split(".")
        node = doc["spec"]
        for key in parents:
            node = node[key]
        node[leaf] = value
        proc = _apply(cluster, namespace, doc, check=False)
        assert proc.returncode != 0, (path, proc.stdout)
        assert field in proc.stderr and words in proc.stderr, (path, proc.stderr)
    doc["spec"]["placement"] = {"mode": "Pools"}  # the last one without groups is admitted
    _apply(cluster, namespace, doc)
