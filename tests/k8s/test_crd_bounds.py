"""The CRD's bounds, enforced by the real API server at admission (no operator needed)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.k8s.conftest import ROOT, Cluster

pytestmark = pytest.mark.k8s

EXAMPLE = ROOT / "examples" / "k8s" / "epd-tiny-cpu.yaml"


@pytest.fixture(scope="module")
def crd(cluster: Cluster) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    cluster.kubectl(
        "wait", "--for", "condition=Established", "--timeout", "60s",
        "crd/epddeployments.epd.serving.dev",
    )  # fmt: skip


def _set(path: str, value: Any) -> Any:
    def mutate(spec: dict) -> None:
        *parents, leaf = path.split(".")
        node = spec
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value

    return mutate


@pytest.mark.parametrize(
    ("mutate", "field", "words"),
    [
        (_set("engine.gpusPerInstance", 2), "spec.engine.gpusPerInstance",
         "less than or equal to 1"),
        (_set("router.replicas", 9), "spec.router.replicas", "less than or equal to 8"),
        (_set("engine.resources.limits.memory", "8Gb"), "spec.engine.resources.limits.memory",
         "should match"),
        (_set("engine.extraArgs", ["--x"] * 65), "spec.engine.extraArgs", "at most 64"),
    ],
    ids=["gpus-per-instance", "router-replicas", "memory-quantity", "extra-args"],
)  # fmt: skip
def test_api_server_rejects_values_the_engine_cannot_run(
    cluster: Cluster, crd: None, namespace: str, mutate: Any, field: str, words: str
) -> None:
    """Defect: gpusPerInstance up to 16, router replicas up to 64 and any quantity string were
    admitted; a bad quantity then failed as a 422 on the child Deployment, retried silently."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    mutate(doc["spec"])
    proc = cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(doc), check=False
    )
    assert proc.returncode != 0, proc.stdout
    assert field in proc.stderr and words in proc.stderr, proc.stderr
    assert cluster.get("epddeployment", doc["metadata"]["name"], "-n", namespace) is None


def test_api_server_accepts_the_bounds_themselves(
    cluster: Cluster, crd: None, namespace: str
) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    for mutate in (
        _set("engine.gpusPerInstance", 1),
        _set("router.replicas", 8),
        _set("engine.resources.limits.memory", "1536Mi"),
    ):
        mutate(doc["spec"])
    cluster.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(doc)
    )
