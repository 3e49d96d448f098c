"""Operator settings from the environment (the only module that reads it; prefix ``EPD_``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

EXIT_AT_CODE = 75  # how a process stopped by EPD_OPERATOR_EXIT_AT exits


@dataclass(frozen=True)
class OperatorSettings:
    resync_s: float = 10.0  # level-triggered pass interval
    # while a rollout is in progress (Progressing=True) or the spec changed: new pods are seen
    # Ready, the routing switched and drained pools deleted within seconds, not a resync
    rollout_resync_s: float = 2.0
    router_timeout_s: float = 2.0  # internal API calls to the router
    plan_timeout_s: float = 60.0  # Auto: the plan search is killed after this (heuristic then)
    plan_max_requests: int = 1000  # Auto: larger trace windows are sampled down to this
    # The router replicas' addresses, when the operator cannot reach pod IPs (it runs outside
    # the cluster, or a test gives it a router on loopback); empty: the router pods' IPs.
    router_urls: tuple[str, ...] = ()
    metrics_port: int = 0  # the operator's own /metrics (operator_metrics.py); 0: not served
    # Restart drills only: the process exits at once (as if killed) when a rollout pass
    # reaches this point (``rollout.driver.CHECKPOINTS``), before status is written.
    exit_at: str = ""

    @classmethod
    def from_env(cls) -> OperatorSettings:
        env = os.environ
        return cls(
            resync_s=float(env.get("EPD_OPERATOR_RESYNC_S", cls.resync_s)),
            rollout_resync_s=float(env.get("EPD_OPERATOR_ROLLOUT_RESYNC_S", cls.rollout_resync_s)),
            router_timeout_s=float(env.get("EPD_OPERATOR_ROUTER_TIMEOUT_S", cls.router_timeout_s)),
            plan_timeout_s=float(env.get("EPD_OPERATOR_PLAN_TIMEOUT_S", cls.plan_timeout_s)),
            plan_max_requests=int(env.get("EPD_OPERATOR_PLAN_MAX_REQUESTS", cls.plan_max_requests)),
            metrics_port=int(env.get("EPD_OPERATOR_METRICS_PORT", cls.metrics_port)),
            router_urls=tuple(
                u.strip() for u in env.get("EPD_OPERATOR_ROUTER_URLS", "").split(",") if u.strip()
            ),
            exit_at=env.get("EPD_OPERATOR_EXIT_AT", ""),
        )

    def checkpoint(self, point: str) -> None:
        """A rollout pass reached ``point``: exit there when a restart drill asks for it."""
        if point == self.exit_at:
            print(f"EPD_OPERATOR_EXIT_AT={point}: exiting mid-pass", file=sys.stderr, flush=True)
            os._exit(EXIT_AT_CODE)

    @property
    def timer_interval_s(self) -> float:
        """The kopf timer's interval; ``pass_due`` skips the ticks that are not due."""
        return min(self.resync_s, self.rollout_resync_s)

    def pass_due(
        self,
        status: Mapping[str, Any],
        generation: int,
        last_pass_s: float | None,
        now_s: float,
    ) -> bool:
        """Whether a reconcile pass is due: the first one, then every ``rollout_resync_s``
        (or ``resync_s`` if shorter) while the last status says a rollout is in progress or
        the spec changed since it, else every ``resync_s`` (monotonic seconds)."""
        if last_pass_s is None:
            return True
        progressing = any(
            c.get("type") == "Progressing" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        changed = status.get("observedGeneration") != generation
        interval = self.timer_interval_s if progressing or changed else self.resync_s
        return now_s - last_pass_s >= interval - 0.05  # a tick a little early still counts
