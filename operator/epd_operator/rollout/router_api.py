"""Client of the router: its internal API (drains) and its live trace (Auto mode re-plans).

``GET /internal/pools`` -> ``{"active_pools": [...], "pools": {name: {"inflight": n, ...}}}``;
``PUT /internal/routing`` ``{"active_pools": [...]}`` -> the pools that get new requests.
Both carry the shared ``X-EPD-Token``. ``GET /v1/trace?since=S`` (or ``?last=S``) -> JSONL
trace records, arrival times in seconds since router start, with that clock's current value
in ``X-EPD-Trace-Clock-S``. When the router cannot be reached (no container runs in the kwok
test cluster; a router restarting) the calls return None/False and the operator falls back
to the drain timeout, or plans without the trace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from epd_engine.contracts.plan import Plan
from epd_engine.contracts.trace import TraceRecord, duration_s, parse_trace, tail_window, window
from epd_engine.local import http_calls

TOKEN_HEADER = "X-EPD-Token"
TRACE_CLOCK_HEADER = "X-EPD-Trace-Clock-S"


@dataclass(frozen=True)
class TraceWindow:
    """The router's recent trace: records rebased to the window start, and the seconds the
    window really covers (shorter than asked while the router is younger than the window)."""

    records: list[TraceRecord]
    span_s: float


@dataclass(frozen=True)
class PoolsState:
    """One router's ``GET /internal/pools``: its routing (None: every registered pool) and
    requests in flight per pool."""

    routing: frozenset[str] | None
    in_flight: dict[str, int]


class RouterAPI:
    def __init__(self, base_url: str, token: str, timeout_s: float = 2.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {TOKEN_HEADER: token}
        self.timeout_s = timeout_s

    def in_flight(self) -> dict[str, int] | None:
        """Requests in flight per pool, or None when the router cannot be asked."""
        state = self.pools_state()
        return None if state is None else state.in_flight

    def pools_state(self) -> PoolsState | None:
        """The pools this router sends new requests to and its in-flight count per pool, from
        one answer (so the count is read after the routing it reports); None when the router
        cannot be asked."""
        try:
            resp = http_calls.get(
                f"{self.base_url}/internal/pools", headers=self.headers, timeout=self.timeout_s
            )
            resp.raise_for_status()
            payload = resp.json()
            active = payload.get("active_pools") if isinstance(payload, dict) else None
            routing = None if active is None else frozenset(str(n) for n in active)
            return PoolsState(routing, parse_in_flight(payload))
        except (httpx.HTTPError, ValueError):
            return None

    def waiting(self) -> dict[str, tuple[str, int, int]] | None:
        """Per pool: its role, instances and requests waiting in their schedulers (the
        instances' heartbeats); None when the router cannot be asked."""
        try:
            resp = http_calls.get(
                f"{self.base_url}/internal/pools", headers=self.headers, timeout=self.timeout_s
            )
            resp.raise_for_status()
            pools = resp.json()["pools"]
            return {
                str(name): (
                    str(info["role"]),
                    len(info["instances"]),
                    sum(int(i.get("num_waiting", 0)) for i in info["instances"]),
                )
                for name, info in pools.items()
            }
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def trace(self, since_s: float = 0.0) -> list[TraceRecord] | None:
        """Requests that arrived ``since_s`` seconds after router start or later; None when
        the router cannot be asked or answers something that is not a trace."""
        got = self._trace({"since": since_s})
        return None if got is None else got[0]

    def trace_window(self, window_s: float, in_flight: bool = False) -> TraceWindow | None:
        """The last ``window_s`` seconds of the trace, rebased to start at 0; None as ``trace``.
        With ``in_flight``, the requests not finished yet too (``TraceRecord.in_flight``)."""
        params: dict[str, float] = {"last": window_s}
        if in_flight:
            params["in_flight"] = 1
        got = self._trace(params)
        if got is None:
            return None
        records, clock_s = got
        if clock_s is None:  # a router without the clock header: window by the last arrival
            recent = tail_window(records, window_s)
            return TraceWindow(recent, min(window_s, duration_s(records)))
        start_s = max(0.0, clock_s - window_s)
        return TraceWindow(window(records, start_s, float("inf")), clock_s - start_s)

    def _trace(self, params: dict[str, float]) -> tuple[list[TraceRecord], float | None] | None:
        try:
            resp = http_calls.get(
                f"{self.base_url}/v1/trace",
                params=params,
                headers=self.headers,
                timeout=httpx.Timeout(max(self.timeout_s, 10.0), connect=self.timeout_s),
            )
            resp.raise_for_status()
            records = parse_trace(resp.text.splitlines(), f"{self.base_url}/v1/trace")
            clock = resp.headers.get(TRACE_CLOCK_HEADER)
            return records, float(clock) if clock is not None else None
        except (httpx.HTTPError, ValueError):
            return None

    def set_routing(self, pools: list[str], plan: Plan | None = None) -> bool:
        """Send new requests to ``pools`` only (the plan they serve shows in ``epd_plan_info``);
        False when the router did not take it."""
        body: dict[str, Any] = {"active_pools": sorted(pools)}
        if plan is not None:
            body["plan"] = plan.model_dump(mode="json")
        try:
            resp = http_calls.put(
                f"{self.base_url}/internal/routing",
                json=body,
                headers=self.headers,
                timeout=self.timeout_s,
            )
            resp.raise_for_status()
            return True
        except httpx.HTTPError:
            return False


def parse_in_flight(payload: Any) -> dict[str, int]:
    """Accept ``{"pools": {name: {...}}}``, ``{"pools": [{"name"|"pool": ..}]}`` or a bare map.

    A pool's in-flight count is its ``inflight`` (or ``in_flight``) field, else the sum over
    its ``instances``.
    """
    pools = payload.get("pools", payload) if isinstance(payload, dict) else payload
    items = (
        pools.items()
        if isinstance(pools, dict)
        else ((p.get("name") or p.get("pool"), p) for p in pools)
    )
    out: dict[str, int] = {}
    for name, info in items:
        if not isinstance(info, dict) or not name:
            raise ValueError(f"unexpected /internal/pools entry: {info!r}")
        count = info.get("inflight", info.get("in_flight"))
        if count is None:
            count = sum(
                int(i.get("inflight", i.get("in_flight", 0))) for i in info.get("instances", [])
            )
        out[str(name)] = int(count)
    return out
