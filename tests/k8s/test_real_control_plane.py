"""The control plane's own failures on real pods (issue 36): two router replicas behind the
router Service under traffic, and the chart's operator pod killed in the middle of a method
switch. One namespace and one EPDDeployment (the tiny CPU model, ``router.replicas: 2``)
serve both drills, in this order: each real-pod module costs minutes of CI.

Everything is real: the operator runs as its pod, routers and engines run our images on the
real node, clients reach the router Service's ClusterIP (kube-proxy spreads connections
over the two router pods), and the operator pod is force-deleted as a crashed node agent or
an eviction would take it. Needs the real node and ``make images``; skips without them
unless EPD_REQUIRE_REAL_NODE=1 (CI).

A real node lost under traffic is drilled in test_real_node_lost.py.
"""

from __future__ import annotations

import base64
import json
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
import yaml

from epd_engine.contracts.request_owner import owner_of
from epd_operator.kube import manifests as r
from epd_operator.kube.names import ENGINE_PORT
from tests.k8s.conftest import Cluster, wait_until
from tests.k8s.real_node import (
    RELEASE,
    RELEASE_NAMESPACE,
    Traffic,
    real_namespace,
    red_image_url,
    router_client,
    tiny_manifest,
)

pytestmark = [pytest.mark.k8s, pytest.mark.slow]
__all__ = ["real_namespace"]  # the fixture, used by name

NAME = "ctl"
NUM_PROMPTS = 8
ASKS_PER_PROMPT = 4  # through the Service, each on a connection of its own
MAX_TOKENS = 8


def epd(cluster: Cluster, ns: str) -> dict[str, Any]:
    return cluster.get("epddeployment", NAME, "-n", ns) or {}


def condition(obj: dict[str, Any], ctype: str) -> dict[str, Any]:
    found = (obj.get("status") or {}).get("conditions", [])
    return next((c for c in found if c["type"] == ctype), {})


def serving(cluster: Cluster, ns: str, method: str) -> dict[str, Any] | None:
    """The object when Ready on its generation with ``method``, the rollout complete."""
    obj = epd(cluster, ns)
    status = obj.get("status") or {}
    ready = condition(obj, "Ready")
    ok = (
        ready.get("status") == "True"
        and ready.get("observedGeneration") == obj["metadata"]["generation"]
        and condition(obj, "Progressing").get("reason") == "RolloutComplete"
        and (status.get("plan") or {}).get("method") == method
    )
    return obj if ok else None


def pods(cluster: Cluster, ns: str, component: str) -> list[dict[str, Any]]:
    """Ready pods of ``component`` not being deleted."""
    found = cluster.items("pods", "-n", ns, "-l", f"{r.LABEL_COMPONENT}={component}")
    return [
        p
        for p in found
        if not p["metadata"].get("deletionTimestamp")
        and any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in (p.get("status") or {}).get("conditions") or []
        )
    ]


def engine_pools(cluster: Cluster, ns: str) -> dict[str, str]:
    """Engine Deployments not being deleted: name -> uid."""
    found = cluster.items("deployments", "-n", ns, "-l", f"{r.LABEL_COMPONENT}=engine")
    return {
        d["metadata"]["name"]: d["metadata"]["uid"]
        for d in found
        if not d["metadata"].get("deletionTimestamp")
    }


def token(cluster: Cluster, ns: str) -> str:
    secret = cluster.get("secret", f"{NAME}-internal-token", "-n", ns)
    return base64.b64decode(secret["data"]["token"]).decode()


def replica_pools(cluster: Cluster, ns: str) -> list[dict[str, Any]]:
    """Each router pod's own ``/internal/pools`` (its id, its routing), by pod IP."""
    secret = {"X-EPD-Token": token(cluster, ns)}
    port = epd(cluster, ns)["spec"]["router"]["port"]
    found = []
    for pod in pods(cluster, ns, "router"):
        url = f"http://{pod['status']['podIP']}:{port}/internal/pools"
        found.append(httpx.get(url, headers=secret, timeout=10).json())
    return found


@pytest.fixture(scope="module")
def ctl(cluster: Cluster, real_namespace: str) -> str:
    doc = tiny_manifest(NAME, {"method": "EPD", "pools": {"EPD": 1}})
    doc["spec"]["router"]["replicas"] = 2
    cluster.kubectl("apply", "-n", real_namespace, "-f", "-", stdin=yaml.safe_dump(doc))
    wait_until("EPD serving", lambda: serving(cluster, real_namespace, "EPD"), 420, every_s=1)
    wait_until(
        "both router pods Ready",
        lambda: len(pods(cluster, real_namespace, "router")) == 2 or None,
        180,
        every_s=1,
    )
    return real_namespace


def prompt(n: int) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": f"Describe picture {n}."}]
    if n % 2:
        content.append({"type": "image_url", "image_url": {"url": red_image_url()}})
    return {"role": "user", "content": content}


def answer(base_url: str, n: int, stream: bool) -> tuple[list[str], str]:
    """Prompt ``n``'s tokens (from logprobs) and the answer's id, over a connection of its
    own (kube-proxy picks a router pod per connection)."""
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120) as c:
        kwargs: dict[str, Any] = {
            "model": "tiny-llava",
            "messages": [prompt(n)],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "logprobs": True,
            "extra_body": {"ignore_eos": True},
        }
        if not stream:
            done = c.chat.completions.create(**kwargs)
            content = done.choices[0].logprobs.content or []
            return [t.token for t in content], done.id
        tokens: list[str] = []
        request_id = ""
        for chunk in c.chat.completions.create(stream=True, **kwargs):
            request_id = request_id or chunk.id
            for choice in chunk.choices:
                tokens += (
                    [t.token for t in (choice.logprobs.content or [])] if choice.logprobs else []
                )
        return tokens, request_id


def test_two_router_replicas_answer_every_request_as_one_instance_does(
    cluster: Cluster, ctl: str
) -> None:
    """Requests through the Service, spread over both router pods, streaming and not, with
    and without an image: each one's tokens are those the engine pod answers directly, and
    none fails; both replicas own some of them."""
    ns = ctl
    (engine,) = pods(cluster, ns, "engine")
    direct = f"http://{engine['status']['podIP']}:{ENGINE_PORT}/v1"
    expected = {n: answer(direct, n, stream=False)[0] for n in range(NUM_PROMPTS)}
    assert all(len(tokens) == MAX_TOKENS for tokens in expected.values()), expected

    service = str(router_client(cluster, ns, NAME).base_url).rstrip("/")
    asks = [(n, k % 2 == 1) for n in range(NUM_PROMPTS) for k in range(ASKS_PER_PROMPT)]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(answer, service, n, stream) for n, stream in asks]
        outcomes = [f.exception() or f.result() for f in futures]
    failed = [
        (ask, o) for ask, o in zip(asks, outcomes, strict=True) if isinstance(o, BaseException)
    ]
    assert not failed, failed
    got = [o for o in outcomes if not isinstance(o, BaseException)]
    differ = [
        (n, stream, tokens, expected[n])
        for (n, stream), (tokens, _) in zip(asks, got, strict=True)
        if tokens != expected[n]
    ]
    assert not differ, differ
    replicas = {p["router_id"] for p in replica_pools(cluster, ns)}
    owners = {owner_of(request_id) for _, request_id in got}
    assert len(replicas) == 2 and owners == replicas, (owners, replicas)
    per_owner = Counter(owner_of(request_id) for _, request_id in got)
    print(f"{len(got)} requests through the Service, 0 failed, each token-identical to the "
          f"engine's own answer; per router replica: {sorted(per_owner.values())}")  # fmt: skip


def test_the_operator_pod_killed_mid_switch_the_switch_completes_losing_nothing(
    cluster: Cluster, ctl: str
) -> None:
    """EPD -> EP+D under traffic through both router replicas; the operator pod is
    force-deleted (no grace) while the switch waits for its new pools. The Deployment's new
    operator pod resumes from the object's status and the cluster: the switch completes,
    the pools made before the kill are the ones serving (none made twice), the old pool is
    gone, every router replica routes to the new pools, and no request fails."""
    ns = ctl
    before = engine_pools(cluster, ns)
    operator_selector = f"app.kubernetes.io/instance={RELEASE}"
    (operator,) = [
        p["metadata"]["name"]
        for p in cluster.items("pods", "-n", RELEASE_NAMESPACE, "-l", operator_selector)
    ]
    client = router_client(cluster, ns, NAME)
    killed: dict[str, Any] = {}
    with Traffic(client) as traffic:
        wait_until("traffic flowing", lambda: traffic.count() >= 4, 120)
        patch = {
            "spec": {"disaggregation": {"method": "EP+D", "pools": {"EPD": None, "EP": 1, "D": 1}}}
        }
        cluster.kubectl("patch", "epd", NAME, "-n", ns, "--type", "merge", "-p", json.dumps(patch))
        generation = epd(cluster, ns)["metadata"]["generation"]

        def waiting_for_pools() -> dict[str, Any] | None:
            obj = epd(cluster, ns)
            progressing = condition(obj, "Progressing")
            mid = (
                progressing.get("reason") == "WaitingForPools"
                and progressing.get("observedGeneration") == generation
            )
            return obj if mid else None

        at_kill = wait_until("the switch waiting for its new pools", waiting_for_pools, 120, 0.2)
        killed["pools"] = engine_pools(cluster, ns)
        cluster.kubectl(
            "delete", "pod", operator, "-n", RELEASE_NAMESPACE, "--grace-period=0", "--force"
        )
        killed_s = time.monotonic()
        done = wait_until("EP+D serving", lambda: serving(cluster, ns, "EP+D"), 420, every_s=1)
        completed_after_s = time.monotonic() - killed_s
        before_count = traffic.count()
        wait_until("answers after the switch", lambda: traffic.count() >= before_count + 4, 120)

    # the kill came mid-switch: the new pools existed, the old one still served
    new_at_kill = set(killed["pools"]) - set(before)
    assert len(new_at_kill) == 2 and set(before) <= set(killed["pools"]), killed
    # a new operator pod finished it
    now = cluster.items("pods", "-n", RELEASE_NAMESPACE, "-l", operator_selector)
    assert operator not in [p["metadata"]["name"] for p in now], now
    after = engine_pools(cluster, ns)
    assert set(after) == new_at_kill and set(done["status"]["activePools"]) == new_at_kill
    assert all(after[name] == killed["pools"][name] for name in after), (killed, after)
    routing = [set(p["active_pools"] or []) for p in replica_pools(cluster, ns)]
    assert routing == [new_at_kill, new_at_kill], routing
    assert traffic.failures == [], traffic.failures[:5]
    events = cluster.items("events", "-n", ns, "--field-selector", f"involvedObject.name={NAME}")
    switched = [e["message"] for e in events if e["reason"] == "Switched"]
    assert any(", ".join(sorted(new_at_kill)) in m for m in switched), switched
    print(
        f"operator pod killed at {condition(at_kill, 'Progressing')['reason']}; the switch "
        f"complete {completed_after_s:.0f} s later; {traffic.count()} requests, 0 failed"
    )
