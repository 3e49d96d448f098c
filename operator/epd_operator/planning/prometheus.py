"""Prometheus HTTP API client: the live workload the profiler re-plans on.

Reads the ``epd_`` metrics (DESIGN.md §4, engine/epd_engine/metrics.py) over the profiler's
trace window: finished requests (``epd_requests_total``) and SLO attainment
(``epd_slo_met_total``). Per-request prompt/image/output means come from the router's
histograms ``epd_request_{prompt_tokens,images,output_tokens}``; missing series give None
and the planner falls back to defaults. Every query is instant
(``/api/v1/query``); an unreachable server gives None and the operator keeps its plan.

With both sources, the trace (one router replica's, read through the Service) gives the
workload's shape and Prometheus the SLO attainment: it counts every replica and every
outcome (``with_live_attainment``).
"""

from __future__ import annotations

from dataclasses import replace

import httpx

from epd_engine.local import http_calls
from epd_operator.planning.choice import WorkloadStats


class Prometheus:
    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def scalar(self, expr: str) -> float | None:
        try:
            resp = http_calls.get(
                f"{self.url}/api/v1/query", params={"query": expr}, timeout=self.timeout_s
            )
            resp.raise_for_status()
            body = resp.json()
        except (httpx.HTTPError, ValueError):
            return None
        result = body.get("data", {}).get("result", [])
        if body.get("status") != "success" or not result:
            return None
        value = float(result[0]["value"][1])
        return None if value != value else value  # NaN: no samples

    def requests(
        self, model: str, namespace: str, window_s: int, offset_s: int = 0
    ) -> float | None:
        """Requests finished (``epd_requests_total``) in the ``window_s`` seconds that ended
        ``offset_s`` seconds ago."""
        sel = f'model="{model}",namespace="{namespace}"'
        offset = f" offset {offset_s}s" if offset_s else ""
        return self.scalar(f"sum(increase(epd_requests_total{{{sel}}}[{window_s}s]{offset}))")

    def workload(self, model: str, namespace: str, window_s: int) -> WorkloadStats | None:
        sel = f'model="{model}",namespace="{namespace}"'
        w = f"{window_s}s"

        def mean(metric: str) -> str:
            return (
                f"sum(increase({metric}_sum{{{sel}}}[{w}])) / "
                f"sum(increase({metric}_count{{{sel}}}[{w}]))"
            )

        num = self.requests(model, namespace, window_s)
        if num is None:
            return None
        met = self.scalar(f"sum(increase(epd_slo_met_total{{{sel}}}[{w}]))")
        return WorkloadStats(
            num_requests=int(num),
            request_rate_rps=num / window_s,
            mean_prompt_tokens=self.scalar(mean("epd_request_prompt_tokens")),
            mean_images=self.scalar(mean("epd_request_images")),
            mean_output_tokens=self.scalar(mean("epd_request_output_tokens")),
            slo_attainment=met / num if met is not None and num > 0 else None,
        )


def with_live_attainment(
    trace: WorkloadStats | None, live: WorkloadStats | None
) -> WorkloadStats | None:
    """The trace's statistics with Prometheus' SLO attainment (all router replicas), or
    whichever of the two exists."""
    if trace is None:
        return live
    if live is None or live.slo_attainment is None:
        return trace
    return replace(trace, slo_attainment=live.slo_attainment)
