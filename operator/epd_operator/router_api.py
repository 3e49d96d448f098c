"""Client of the router's internal API, used to drain pools before deleting them.

``GET /internal/pools`` -> ``{"active_pools": [...], "pools": {name: {"inflight": n, ...}}}``;
``PUT /internal/routing`` ``{"active_pools": [...]}`` -> the pools that get new requests.
Both carry the shared ``X-EPD-Token``. When the router cannot be reached (no container runs
in the kwok test cluster; a router restarting) the calls return None/False and the operator
falls back to the drain timeout.
"""

from __future__ import annotations

from typing import Any

import httpx

TOKEN_HEADER = "X-EPD-Token"


class RouterAPI:
    def __init__(self, base_url: str, token: str, timeout_s: float = 2.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {TOKEN_HEADER: token}
        self.timeout_s = timeout_s

    def in_flight(self) -> dict[str, int] | None:
        """Requests in flight per pool, or None when the router cannot be asked."""
        try:
            resp = httpx.get(
                f"{self.base_url}/internal/pools", headers=self.headers, timeout=self.timeout_s
            )
            resp.raise_for_status()
            return parse_in_flight(resp.json())
        except (httpx.HTTPError, ValueError):
            return None

    def set_routing(self, pools: list[str]) -> bool:
        try:
            resp = httpx.put(
                f"{self.base_url}/internal/routing",
                json={"active_pools": sorted(pools)},
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
