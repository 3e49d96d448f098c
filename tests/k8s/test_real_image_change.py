"""A new engine image under traffic on the real node (issue 30, "upgrades without an outage"):
the pool's pods are replaced one by one through the drain (RollingUpdate, surge one), not
recreated, and the clients see no failure.

The new image is the same build under a second tag (`ctr images tag` on the node), so the
kubelet starts new containers exactly as for a real upgrade while nothing is pulled. Needs
the real node and `make images`; skips without them unless EPD_REQUIRE_REAL_NODE=1 (CI).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from epd_operator.kube import manifests as r
from tests.k8s.conftest import Cluster, wait_until
from tests.k8s.real_node import (
    IMAGES,
    Traffic,
    node_ctr,
    real_namespace,
    router_client,
    tiny_manifest,
)
from tests.k8s.test_real_pods import engine_pods, record, wait_serving

pytestmark = [pytest.mark.k8s, pytest.mark.slow]
__all__ = ["real_namespace"]  # the fixture, used by name

NAME = "tiny"  # wait_serving follows the EPDDeployment of this name
NEW_IMAGE = "epd-engine:retagged"


def pod_images(cluster: Cluster, ns: str) -> dict[str, tuple[str, bool]]:
    """Engine pods not being deleted -> (their image, Ready)."""
    out = {}
    for pod in cluster.items("pods", "-n", ns, "-l", f"{r.LABEL_COMPONENT}=engine"):
        if pod["metadata"].get("deletionTimestamp"):
            continue
        conditions = (pod.get("status") or {}).get("conditions") or []
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
        out[pod["metadata"]["name"]] = (pod["spec"]["containers"][0]["image"], ready)
    return out


def test_an_image_change_rolls_pod_by_pod_losing_nothing(
    cluster: Cluster, real_namespace: str
) -> None:
    ns = real_namespace
    source = f"docker.io/library/{IMAGES['engine']}"
    node_ctr("images", "tag", "--force", source, f"docker.io/library/{NEW_IMAGE}")
    doc = tiny_manifest(NAME, {"method": "EPD", "pools": {"EPD": 2}})
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(doc))
    wait_serving(cluster, ns, "EPD")
    wait_until("2 EPD pods", lambda: len(engine_pods(cluster, ns, ready_only=True)) == 2, 180)
    pools_before = set(engine_pods(cluster, ns).values())
    old_pods = set(pod_images(cluster, ns))
    ready_counts: list[int] = []

    def rolled() -> bool | None:
        seen = pod_images(cluster, ns)
        ready_counts.append(sum(ready for _, ready in seen.values()))
        new = [ready for image, ready in seen.values() if image == NEW_IMAGE]
        return (len(seen) == 2 and len(new) == 2 and all(new)) or None

    client = router_client(cluster, ns, NAME)
    with Traffic(client) as traffic:
        wait_until("traffic flowing", lambda: traffic.count() >= 4, 60)
        patch: dict[str, Any] = {"spec": {"engine": {"image": NEW_IMAGE}}}
        cluster.kubectl("patch", "epd", NAME, "-n", ns, "--type", "merge", "-p", json.dumps(patch))
        wait_until("every pod on the new image", rolled, 300, every_s=1)
        before = traffic.count()
        wait_until("answers after the rollout", lambda: traffic.count() >= before + 4, 60)
    record("image-change", traffic, ready_counts=ready_counts)
    assert traffic.failures == [], traffic.failures[:5]
    assert set(engine_pods(cluster, ns).values()) == pools_before  # the same pool, rolled
    assert old_pods.isdisjoint(pod_images(cluster, ns))
    assert min(ready_counts) >= 1, ready_counts  # never recreated: a Ready pod all along
