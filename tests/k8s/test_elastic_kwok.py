"""On kwok GPU nodes the pool sizes follow the elastic loop (issue 32): capacity 1-8 GPUs in
mode Auto, the load rises, the pools grow; it falls, they shrink after the stabilisation
window, and never beyond ``minGPUs``/``maxGPUs``.

The real controller against the real API server and kwok's GPU nodes (tools/cluster/nodes.sh),
one pass at a time (``reconcile_once``), its Deployments' pods made Ready by kwok. The router
is a stand-in, a plain HTTP server on loopback: kwok's pods run nothing, so no router can run
there. It answers what the operator asks a router: the trace (a synthetic TextCaps-shaped
window at the rate the test sets), the pools in flight (none) and the routing switch (kept).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any, ClassVar

import pytest
from kubernetes import client

from epd_engine.contracts.trace import dump_record
from epd_engine.workload.arrivals import ArrivalSpec
from epd_engine.workload.generators import synthesize
from epd_operator.api.spec import GROUP, PLURAL, VERSION
from epd_operator.kube import controller
from tests.k8s.conftest import Cluster, wait_until
from tests.k8s.reconcile_once import Pass, loopback_router

pytestmark = pytest.mark.k8s
NAME = "elastic"
WINDOW_S = 60
LONG_AGO = "2020-01-01T00:00:00Z"


class TraceRouter(BaseHTTPRequestHandler):
    """A router's operator-facing API, with a trace at ``rate_rps``."""

    rate_rps: ClassVar[float] = 5.0
    routing: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        if self.path.startswith("/v1/trace"):
            num = int(self.rate_rps * WINDOW_S)
            records = synthesize("textcaps", num, ArrivalSpec("poisson", self.rate_rps), seed=1)
            self._answer("\n".join(dump_record(r) for r in records), "application/jsonl")
        elif self.path.startswith("/internal/pools"):
            self._answer(json.dumps({"active_pools": TraceRouter.routing, "pools": {}}))
        else:
            self._answer("{}", status=404)

    def do_PUT(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        TraceRouter.routing = list(body["active_pools"])
        self._answer(json.dumps({"active_pools": TraceRouter.routing}))

    def _answer(self, text: str, kind: str = "application/json", status: int = 200) -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def router() -> Iterator[str]:
    TraceRouter.rate_rps, TraceRouter.routing = 5.0, []
    with loopback_router(TraceRouter) as url:
        yield url


def manifest() -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "EPDDeployment",
        "metadata": {"name": NAME},
        "spec": {
            "model": {"name": "llava-7b", "source": {"hostPath": {"path": "/mnt/models/llava"}}},
            "gpuBudget": 8,
            "capacity": {"minGPUs": 1, "maxGPUs": 8, "scaleDownStabilizationSeconds": 0},
            "slo": {"ttftMilliseconds": 2000, "tpotMilliseconds": 60, "attainmentPercent": 90},
            "disaggregation": {"mode": "Auto"},
            "profiler": {"intervalSeconds": 30, "traceWindowSeconds": WINDOW_S,
                         "minRequests": 50, "cooldownSeconds": 0},
            "engine": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                        "effect": "NoSchedule"}]},
        },
    }  # fmt: skip


def gpus_of(status: dict[str, Any]) -> int:
    return sum(n or 0 for n in (status.get("plan") or {}).get("pools", {}).values())


def test_pool_sizes_follow_the_load_within_capacity(
    cluster: Cluster, crd: None, namespace: str, router: str
) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=json.dumps(manifest()))
    api = cluster.api_client()
    custom = client.CustomObjectsApi(api)
    uid = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, NAME)["metadata"][
        "uid"
    ]
    run = Pass(api, router_urls=(router,))

    def serving() -> dict[str, Any] | None:
        status = run(namespace, NAME)
        ready = next(c for c in status["conditions"] if c["type"] == "Ready")
        plan_pools = set(status.get("activePools") or [])
        done = ready["status"] == "True" and plan_pools and not status.get("drainingSince")
        return status if done else None

    def replanned_at(rate_rps: float) -> dict[str, Any]:
        """The load changes; a re-plan is due (the last one an interval ago): it runs beside
        the passes and a later pass takes it; then the rollout converges."""
        TraceRouter.rate_rps = rate_rps
        custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, NAME, {"status": {"lastPlanned": LONG_AGO}}
        )
        run(namespace, NAME)  # starts the search
        wait_until("the re-plan", lambda: controller.replan_finished(uid), 60)
        run(namespace, NAME)  # takes it
        return wait_until(f"serving at {rate_rps} rps", serving, 120, every_s=0.5)

    low = wait_until("serving at 5 rps", serving, 120, every_s=0.5)
    assert gpus_of(low) == 1, low["plan"]  # one GPU carries 5 rps (x 1.2 headroom)
    high = replanned_at(40.0)
    assert 3 <= gpus_of(high) <= 8, high["plan"]
    replicas = {
        d["metadata"]["name"]: d["spec"]["replicas"]
        for d in cluster.items("deployments", "-n", namespace)
        if d["metadata"]["name"] in set(high["activePools"])
    }
    assert sum(replicas.values()) == gpus_of(high), replicas  # the pods the plan holds
    again = replanned_at(80.0)  # more than 8 GPUs would carry: capped at maxGPUs
    assert gpus_of(again) <= 8, again["plan"]
    assert gpus_of(again) >= gpus_of(high), (again["plan"], high["plan"])
    back = replanned_at(5.0)
    assert gpus_of(back) == 1, back["plan"]  # down at once: no stabilisation window here
    sizes = [gpus_of(s) for s in (low, high, again, back)]
    print(f"elastic on kwok: 5 -> 40 -> 80 -> 5 rps gave {sizes} GPUs")
