"""Reads the fast path's SLO alarms (``planning.alarm``) from the router each pass: the trace
of the last scrape window and the pool table, whose waiting queues are compared with the
previous pass's (kept here: a restarted operator alarms on queue growth one pass later)."""

from __future__ import annotations

from collections.abc import Iterable

from epd_engine.config import Role
from epd_operator.api.spec import EPDDeploymentSpec
from epd_operator.planning.alarm import Queues, SloAlarm, slo_alarms
from epd_operator.rollout.router_api import RouterAPI


class AlarmReader:
    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.before: Queues | None = None  # the previous pass's queues

    def read(
        self, router: RouterAPI, spec: EPDDeploymentSpec, pools: Iterable[str]
    ) -> list[SloAlarm]:
        """The alarms of this pass for the plan whose pools are ``pools``."""
        queues = plan_queues(router.waiting() or {}, set(pools))
        before, self.before = self.before, queues
        trace = router.trace_window(2 * self.window_s)
        if trace is None:
            return []
        slo = spec.slo.to_slo()
        return slo_alarms(trace.records, trace.span_s, slo, self.window_s, queues, before)


def plan_queues(table: dict[str, tuple[str, int, int]], pools: set[str]) -> Queues:
    """Waiting requests per instance of each role, over the plan's pools only."""
    out: dict[Role, float] = {}
    for name, (role, instances, waiting) in table.items():
        if name in pools and instances:
            out[Role(role)] = waiting / instances
    return out
