"""Emulated engine pods on the real node (``spec.engine.emulate``, issue 32): the chart's
operator runs a pool of ``epdctl serve --emulate`` pods from the engine image, the router
answers the ``openai`` client under the emulated name, and the pool scales 1 -> 3 -> 1 under
streaming and plain traffic with nothing failed. The pool is resized in place: its one
Deployment grows, then shrinks, and each pod scaled away drains on SIGTERM.

Real pods, real kubelet and containerd, real router; only the engine is emulated, which is
the point: the control plane meets what a GPU fleet would make it do, on two CPU cores.
Needs the real node and `make images`; skips without them unless EPD_REQUIRE_REAL_NODE=1.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import openai
import pytest
import yaml
from openai.types.chat import ChatCompletionMessageParam

from epd_operator.kube import manifests as r
from tests.k8s.conftest import LOG_DIR, Cluster, wait_until
from tests.k8s.real_node import events, real_namespace, router_client, tiny_manifest
from tests.k8s.test_real_pods import engine_pods, wait_serving

pytestmark = [pytest.mark.k8s, pytest.mark.slow]
__all__ = ["real_namespace"]  # the fixture, used by name

NAME = "tiny"  # wait_serving's
MODEL = "tiny-llava-emulated"
MAX_TOKENS = 24


@dataclass
class EmulatedTraffic:
    """Two clients, one streaming, asking the emulated model until stopped."""

    client: openai.OpenAI
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)

    def _ask(self, stream: bool) -> None:
        messages: list[ChatCompletionMessageParam] = [
            {"role": "user", "content": "Tell me about rivers."}
        ]
        while not self._stop.is_set():
            try:
                if stream:
                    chunks = self.client.chat.completions.create(
                        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, stream=True
                    )
                    got = sum(1 for c in chunks if c.choices and c.choices[0].delta.content)
                else:
                    answer = self.client.chat.completions.create(
                        model=MODEL, messages=messages, max_tokens=MAX_TOKENS
                    )
                    got = answer.usage.completion_tokens if answer.usage else 0
                assert got == MAX_TOKENS, f"{got} of {MAX_TOKENS} tokens"
                with self._lock:
                    self.ok += 1
            except Exception as exc:  # every failure is the finding
                with self._lock:
                    self.failures.append(f"{time.strftime('%H:%M:%S')} {exc!r}")

    def __enter__(self) -> EmulatedTraffic:
        self._threads = [
            threading.Thread(target=self._ask, args=(stream,), daemon=True)
            for stream in (False, True)
        ]
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=90)

    def count(self) -> int:
        with self._lock:
            return self.ok


def _patch_pools(cluster: Cluster, ns: str, replicas: int) -> None:
    value = {"mode": "Fixed", "method": "EPD", "pools": {"EPD": replicas}}
    patch = [{"op": "replace", "path": "/spec/disaggregation", "value": value}]
    cluster.kubectl("patch", "epd", NAME, "-n", ns, "--type", "json", "-p", json.dumps(patch))


def test_emulated_pods_serve_and_scale_up_and_down_under_traffic(
    cluster: Cluster, real_namespace: str
) -> None:
    ns = real_namespace
    doc = tiny_manifest(NAME, {"method": "EPD", "pools": {"EPD": 1}}, emulate=True)
    del doc["spec"]["engine"]["resources"]  # the emulated pods' own small requests
    doc["spec"]["gpuBudget"] = 6
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(doc))
    wait_serving(cluster, ns, "EPD", timeout_s=180)
    [pod] = cluster.items("pods", "-n", ns, "-l", f"{r.LABEL_COMPONENT}=engine")
    [container] = pod["spec"]["containers"]
    assert "--emulate" in container["args"]
    assert container["resources"]["requests"] == {"cpu": "100m", "memory": "128Mi"}
    client = router_client(cluster, ns, NAME)
    assert [m.id for m in client.models.list().data] == [MODEL]

    sizes: dict[int, float] = {}
    with EmulatedTraffic(client) as traffic:
        wait_until("traffic answered", lambda: traffic.count() >= 6, 60)
        for replicas in (3, 1):
            started = time.monotonic()
            _patch_pools(cluster, ns, replicas)
            wait_serving(cluster, ns, "EPD", timeout_s=180)
            sizes[replicas] = round(time.monotonic() - started, 1)
            wait_until(
                f"{replicas} ready emulated pods",
                lambda r=replicas: len(engine_pods(cluster, ns, ready_only=True)) == r or None,
                120,
                every_s=1,
            )
            before = traffic.count()
            wait_until(f"answers at {replicas}", lambda b=before: traffic.count() >= b + 6, 60)
    reasons = [e["reason"] for e in events(cluster, ns, NAME)]
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    summary = {"ok": traffic.count(), "failures": traffic.failures, "serving_after_s": sizes}
    (LOG_DIR / "real-emulated-pods.json").write_text(json.dumps(summary, indent=1))
    print(f"emulated pods: {summary}; events {reasons}")
    assert traffic.failures == [], traffic.failures[:5]
    assert "DrainTimeout" not in reasons, reasons
    assert reasons.count("ScalingUp") == 1 and reasons.count("ScalingDown") == 1, reasons
    assert "Drained" not in reasons, reasons  # no pool replaced: the one pool was resized
    deployments = cluster.items("deployments", "-n", ns, "-l", f"{r.LABEL_COMPONENT}=engine")
    assert [d["spec"]["replicas"] for d in deployments] == [1], deployments
