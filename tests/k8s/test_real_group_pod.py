"""A placement group on the real node (issue 30): `spec.placement.mode: Groups` with E+P+D
runs one pod whose `epdctl group` holds the E, the P and the D; the members hand images and
KV caches to each other inside the pod, and the answers are the ones one EPD instance gives.

The chart's operator renders the pod, the kubelet runs it from the engine image; which
backend moved each cache is read from the members' own metrics inside the pod (`auto`
picks shared memory there: one kernel and network namespace). Needs the real node and
`make images`; skips without them unless EPD_REQUIRE_REAL_NODE=1 (CI).
"""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.k8s.conftest import Cluster, wait_until
from tests.k8s.real_node import ask, real_namespace, router_client, tiny_manifest
from tests.k8s.test_real_pods import engine_pods, wait_serving

pytestmark = [pytest.mark.k8s, pytest.mark.slow]
__all__ = ["real_namespace"]  # the fixture, used by name

NAME = "tiny"  # wait_serving follows the EPDDeployment of this name
PULLS = re.compile(r"^epd_migration_pull_seconds_count\{([^}]*)\} (\S+)$", re.M)


def member_pulls(cluster: Cluster, ns: str, pod: str, port: int) -> dict[str, float]:
    """``kind/backend`` -> pulls counted by the member on ``port`` (scraped inside the pod)."""
    url = f"http://127.0.0.1:{port}/metrics"
    script = f"import urllib.request; print(urllib.request.urlopen({url!r}).read().decode())"
    text = cluster.kubectl("exec", "-n", ns, pod, "--", "python", "-c", script).stdout
    pulls: dict[str, float] = {}
    for labels, value in PULLS.findall(text):
        fields = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        key = f"{fields.get('kind')}/{fields.get('backend')}"
        pulls[key] = pulls.get(key, 0.0) + float(value)
    return pulls


def test_a_group_pod_serves_epds_answers_moving_caches_inside_the_pod(
    cluster: Cluster, real_namespace: str
) -> None:
    ns = real_namespace
    doc = tiny_manifest(NAME, {"method": "E+P+D", "pools": {"E": 1, "P": 1, "D": 1}})
    doc["spec"]["placement"] = {"mode": "Groups"}
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(doc))
    wait_serving(cluster, ns, "E+P+D", timeout_s=420)
    pods = engine_pods(cluster, ns)
    assert len(pods) == 1, pods  # E, P and D in one pod: the plan's one slice
    (pod,) = pods
    client = router_client(cluster, ns, NAME)
    grouped = [ask(client, with_image=True), ask(client, with_image=False)]

    pulls: dict[str, float] = {}
    for port in (8000, 8001, 8002):  # member i listens on 8000 + i
        for key, count in member_pulls(cluster, ns, pod, port).items():
            pulls[key] = pulls.get(key, 0.0) + count
    # the image went E -> P and both KV caches P -> D, all over shared memory
    assert pulls.get("image/shm", 0) >= 1 and pulls.get("kv/shm", 0) >= 2, pulls
    assert set(pulls) <= {"image/shm", "kv/shm"}, pulls

    epd_plan = {"mode": "Fixed", "method": "EPD", "pools": {"EPD": 1}}
    patch = [
        {"op": "replace", "path": "/spec/placement", "value": {"mode": "Pools"}},
        {"op": "replace", "path": "/spec/disaggregation", "value": epd_plan},
    ]
    cluster.kubectl("patch", "epd", NAME, "-n", ns, "--type", "json", "-p", json.dumps(patch))
    wait_serving(cluster, ns, "EPD", timeout_s=300)
    wait_until(
        "the group pod gone",
        lambda: pod not in engine_pods(cluster, ns) or None,
        120,
    )
    assert len(engine_pods(cluster, ns)) == 1, engine_pods(cluster, ns)
    assert [ask(client, with_image=True), ask(client, with_image=False)] == grouped
