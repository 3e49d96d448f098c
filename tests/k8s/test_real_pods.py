"""End to end on real pods: the chart's operator runs as its pod, engine and router pods run
the images built from our Dockerfiles on the real node (tools/cluster/node.sh: kubelet,
containerd, runc, kube-proxy, CoreDNS), and OpenAI traffic reaches the router's ClusterIP.

Nothing is played here: pods start, probes pass, drains are the router's in-flight counts
reaching zero, and failures are the kubelet's own. Needs the real node and `make images`;
skips without them unless EPD_REQUIRE_REAL_NODE=1 (CI).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from epd_operator.kube import manifests as r
from tests.k8s.conftest import LOG_DIR, Cluster, wait_until
from tests.k8s.real_node import (
    Traffic,
    ask,
    events,
    real_namespace,
    router_client,
    tiny_manifest,
    wait_pods_gone,
)

pytestmark = [pytest.mark.k8s, pytest.mark.slow]
__all__ = ["real_namespace"]  # the fixture, used by name

NAME = "tiny"
SWITCHES: list[tuple[str, dict[str, int]]] = [
    ("EP+D", {"EP": 1, "D": 1}),
    ("ED+P", {"ED": 1, "P": 1}),
    ("E+PD", {"E": 1, "PD": 1}),
    ("EPD", {"EPD": 2}),
]


def epd(cluster: Cluster, ns: str, name: str = NAME) -> dict[str, Any] | None:
    return cluster.get("epddeployment", name, "-n", ns)


def condition(obj: dict[str, Any] | None, ctype: str) -> dict[str, Any]:
    found = ((obj or {}).get("status") or {}).get("conditions", [])
    return next((c for c in found if c["type"] == ctype), {})


def method_of(obj: dict[str, Any] | None) -> str | None:
    return (((obj or {}).get("status") or {}).get("plan") or {}).get("method")


def wait_serving(cluster: Cluster, ns: str, method: str, timeout_s: float = 300) -> dict:
    """Ready on the current generation with ``method``, rollout done, no pool draining."""

    def done() -> dict | None:
        obj = epd(cluster, ns) or {}
        status = obj.get("status") or {}
        ok = (
            condition(obj, "Ready").get("status") == "True"
            and condition(obj, "Ready").get("observedGeneration")
            == obj.get("metadata", {}).get("generation")
            and condition(obj, "Progressing").get("status") == "False"
            and method_of(obj) == method
            and not status.get("drainingSince")
        )
        return obj if ok else None

    return wait_until(f"{NAME} serving {method}", done, timeout_s, every_s=1)


def engine_pods(cluster: Cluster, ns: str, ready_only: bool = False) -> dict[str, str]:
    """Engine pods not being deleted (``ready_only``: and Ready) -> their pool."""
    pods = cluster.items("pods", "-n", ns, "-l", f"{r.LABEL_COMPONENT}=engine")
    return {
        p["metadata"]["name"]: p["metadata"]["labels"][r.LABEL_POOL]
        for p in pods
        if not p["metadata"].get("deletionTimestamp") and (not ready_only or _ready(p))
    }


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def record(what: str, traffic: Traffic, **extra: Any) -> None:
    """What the traffic saw, for the CI log (.build/test-logs/real-pods-*.json)."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    summary = {"ok": traffic.count(), "failures": traffic.failures, **extra}
    (LOG_DIR / f"real-pods-{what}.json").write_text(json.dumps(summary, indent=1))


@pytest.fixture(scope="module")
def tiny(cluster: Cluster, real_namespace: str) -> str:
    doc = tiny_manifest(NAME, {"method": "E+P+D", "pools": {"E": 1, "P": 1, "D": 1}})
    cluster.kubectl("apply", "-n", real_namespace, "-f", "-", stdin=yaml.safe_dump(doc))
    wait_serving(cluster, real_namespace, "E+P+D")
    return real_namespace


def _patch_plan(cluster: Cluster, ns: str, method: str, pools: dict[str, int]) -> None:
    value = {"mode": "Fixed", "method": method, "pools": pools}
    patch = [{"op": "replace", "path": "/spec/disaggregation", "value": value}]
    cluster.kubectl("patch", "epd", NAME, "-n", ns, "--type", "json", "-p", json.dumps(patch))


def test_pods_run_as_non_root_on_a_read_only_root(cluster: Cluster, tiny: str) -> None:
    """The security context as the kubelet applies it, not only as the API server admitted
    it: user 10001, no capabilities, the root filesystem read-only, /tmp writable."""
    probe = (
        "import os, pathlib\n"
        "caps = [l for l in open('/proc/self/status') if l.startswith('CapEff')][0].split()[1]\n"
        "print(os.getuid(), caps)\n"
        "pathlib.Path('/tmp/ok').write_text('x')\n"
        "try:\n    open('/app/x', 'w')\nexcept OSError as e:\n    print(e.errno)\n"
    )
    pods = [*engine_pods(cluster, tiny), _router_pod(cluster, tiny)]
    for pod in pods:
        out = cluster.kubectl("exec", "-n", tiny, pod, "--", "python", "-c", probe).stdout.split()
        assert out == ["10001", "0000000000000000", "30"], (pod, out)  # 30: EROFS


def _router_pod(cluster: Cluster, ns: str) -> str:
    pods = cluster.items("pods", "-n", ns, "-l", f"{r.LABEL_COMPONENT}=router")
    return str(pods[0]["metadata"]["name"])


def test_every_method_answers_and_switches_under_traffic_lose_nothing(
    cluster: Cluster, tiny: str
) -> None:
    """The chart's operator pod rolls the tiny model through every method on real pods while
    two clients keep asking; no request fails, each retired pool drains to zero in flight."""
    ns = tiny
    client = router_client(cluster, ns, NAME)
    assert ask(client, with_image=True) and ask(client, with_image=False)
    served: dict[str, int] = {}
    with Traffic(client) as traffic:
        wait_until("traffic flowing", lambda: traffic.count() >= 4, 60)
        for method, pools in SWITCHES:
            old_pools = set(engine_pods(cluster, ns).values())
            _patch_plan(cluster, ns, method, pools)
            wait_serving(cluster, ns, method)
            now_pools = set(engine_pods(cluster, ns).values())
            assert now_pools.isdisjoint(old_pools - now_pools) and now_pools, now_pools
            before = traffic.count()
            wait_until(f"answers under {method}", lambda b=before: traffic.count() >= b + 4, 60)
            served[method] = traffic.count()
            assert ask(client, with_image=True)
    reasons = [e["reason"] for e in events(cluster, ns, NAME)]
    record("switches", traffic, served_by_method=served, events=reasons)
    assert traffic.failures == [], traffic.failures[:5]
    assert "DrainTimeout" not in reasons, reasons
    assert reasons.count("Drained") >= len(SWITCHES), reasons
    assert len(served) == len(SWITCHES)


def test_deleting_an_engine_pod_mid_traffic_loses_no_request(cluster: Cluster, tiny: str) -> None:
    """Two EPD instances; one pod is deleted (SIGTERM, grace period) while clients ask: the
    router sends new requests to the other, the leaving one finishes its own."""
    ns = tiny
    if method_of(epd(cluster, ns)) != "EPD":
        _patch_plan(cluster, ns, "EPD", {"EPD": 2})
        wait_serving(cluster, ns, "EPD")
    wait_until("2 EPD pods", lambda: len(engine_pods(cluster, ns)) == 2 or None, 120)
    client = router_client(cluster, ns, NAME)
    with Traffic(client) as traffic:
        wait_until("traffic flowing", lambda: traffic.count() >= 4, 60)
        victim = sorted(engine_pods(cluster, ns))[0]
        cluster.kubectl("delete", "pod", victim, "-n", ns, "--wait=true", "--timeout=120s")
        before = traffic.count()
        wait_until("answers after the delete", lambda: traffic.count() >= before + 6, 60)
        wait_until(
            "the replacement pod Ready",
            lambda: len(engine_pods(cluster, ns, ready_only=True)) == 2,
            180,
        )
        assert victim not in engine_pods(cluster, ns)
        before = traffic.count()
        wait_until("answers with both again", lambda: traffic.count() >= before + 6, 60)
    record("pod-delete", traffic)
    assert traffic.failures == [], traffic.failures[:5]


def test_deleting_the_epddeployment_removes_everything(cluster: Cluster, tiny: str) -> None:
    ns = tiny
    cluster.kubectl("delete", "epd", NAME, "-n", ns, "--wait=true", "--timeout=120s")
    selector = f"{r.LABEL_DEPLOYMENT}={NAME}"
    kinds = ("deployments", "services", "configmaps", "networkpolicies", "poddisruptionbudgets")
    for kind in kinds:
        wait_until(
            f"{kind} of {NAME} gone",
            lambda k=kind: not cluster.items(k, "-n", ns, "-l", selector) or None,
            120,
            every_s=1,
        )
    assert cluster.get("secret", f"{NAME}-internal-token", "-n", ns) is None
    wait_pods_gone(cluster, ns)


# --- Degraded from the kubelet's own findings ------------------------------------------------

FAILURES = {
    "bad-image": ({"image": "epd-engine:no-such-tag"}, "ImagePullFailed"),
    "exits": ({"extraArgs": ["--no-such-flag"]}, "CrashLoop"),
    "oom": (
        {"resources": {"requests": {"memory": "48Mi"}, "limits": {"memory": "48Mi"}}},
        "OOMKilled",
    ),
}


@pytest.mark.parametrize("case", sorted(FAILURES))
def test_real_pod_failures_are_degraded_naming_the_pod(
    cluster: Cluster, real_namespace: str, case: str
) -> None:
    """A bad image tag, an engine command that exits, a memory limit too small: the kubelet's
    ErrImageNeverPull, CrashLoopBackOff and OOMKilled become Degraded with the pod named and
    a Warning event."""
    ns = real_namespace
    engine, reason = FAILURES[case]
    name = f"fail-{case}"
    doc = tiny_manifest(name, {"method": "EPD", "pools": {"EPD": 1}}, **engine)
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(doc))
    try:

        def degraded() -> dict | None:
            c = condition(epd(cluster, ns, name), "Degraded")
            return c if c.get("status") == "True" and c.get("reason") == reason else None

        found = wait_until(f"{name} Degraded {reason}", degraded, 240, every_s=1)
        pods = cluster.items("pods", "-n", ns, "-l", f"{r.LABEL_DEPLOYMENT}={name}")
        assert any(p["metadata"]["name"] in found["message"] for p in pods), found
        warnings = [e for e in events(cluster, ns, name) if e["type"] == "Warning"]
        assert any(e["reason"] == reason for e in warnings), warnings
    finally:
        cluster.kubectl("delete", "epd", name, "-n", ns, "--wait=true", "--timeout=120s")
