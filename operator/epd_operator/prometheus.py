"""Prometheus HTTP API client: the live workload the profiler re-plans on.

Reads the router's ``epd_`` metrics (DESIGN.md §4) over the profiler's trace window. Every
query is instant (``/api/v1/query``); a missing series or an unreachable server gives None,
and the operator then keeps its current plan.
"""

from __future__ import annotations

import httpx

from epd_operator.loop import WorkloadStats


class Prometheus:
    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def scalar(self, expr: str) -> float | None:
        try:
            resp = httpx.get(
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

    def workload(self, model: str, namespace: str, window_s: int) -> WorkloadStats | None:
        sel = f'model="{model}",namespace="{namespace}"'
        w = f"{window_s}s"

        def mean(metric: str) -> str:
            return (
                f"sum(increase({metric}_sum{{{sel}}}[{w}])) / "
                f"sum(increase({metric}_count{{{sel}}}[{w}]))"
            )

        num = self.scalar(f"sum(increase(epd_requests_total{{{sel}}}[{w}]))")
        if num is None:
            return None
        prompt = self.scalar(mean("epd_request_prompt_tokens"))
        images = self.scalar(mean("epd_request_images"))
        output = self.scalar(mean("epd_request_output_tokens"))
        return WorkloadStats(
            num_requests=int(num),
            request_rate_rps=num / window_s,
            mean_prompt_tokens=prompt or 0.0,
            mean_images=images or 0.0,
            mean_output_tokens=output or 0.0,
        )
