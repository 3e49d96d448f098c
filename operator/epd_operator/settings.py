"""Operator settings from the environment (the only module that reads it; prefix ``EPD_``)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class OperatorSettings:
    resync_s: float = 10.0  # level-triggered timer interval
    router_timeout_s: float = 2.0  # internal API calls to the router
    plan_timeout_s: float = 60.0  # Auto: the plan search is killed after this (heuristic then)
    plan_max_requests: int = 1000  # Auto: larger trace windows are sampled down to this
    # The router replicas' addresses, when the operator cannot reach pod IPs (it runs outside
    # the cluster, or a test gives it a router on loopback); empty: the router pods' IPs.
    router_urls: tuple[str, ...] = ()
    metrics_port: int = 0  # the operator's own /metrics (operator_metrics.py); 0: not served

    @classmethod
    def from_env(cls) -> OperatorSettings:
        env = os.environ
        return cls(
            resync_s=float(env.get("EPD_OPERATOR_RESYNC_S", cls.resync_s)),
            router_timeout_s=float(env.get("EPD_OPERATOR_ROUTER_TIMEOUT_S", cls.router_timeout_s)),
            plan_timeout_s=float(env.get("EPD_OPERATOR_PLAN_TIMEOUT_S", cls.plan_timeout_s)),
            plan_max_requests=int(env.get("EPD_OPERATOR_PLAN_MAX_REQUESTS", cls.plan_max_requests)),
            metrics_port=int(env.get("EPD_OPERATOR_METRICS_PORT", cls.metrics_port)),
            router_urls=tuple(
                u.strip() for u in env.get("EPD_OPERATOR_ROUTER_URLS", "").split(",") if u.strip()
            ),
        )
