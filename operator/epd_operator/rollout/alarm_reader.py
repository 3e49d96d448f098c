"""Reads the fast path's SLO alarms (``planning.alarm``) from the router each pass: the trace
of the last scrape window and the pool table, whose waiting queues are compared with the
previous passes' (kept here: a restarted operator alarms on queue growth a few passes later)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from epd_engine.config import Role
from epd_operator.api.spec import EPDDeploymentSpec
from epd_operator.planning.alarm import QUEUE_READINGS, Queues, SloAlarm, slo_alarms
from epd_operator.rollout.router_api import RouterAPI


class AlarmReader:
    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        # the previous passes' queues, oldest first
        self.earlier: deque[Queues] = deque(maxlen=QUEUE_READINGS - 1)

    def read(
        self, router: RouterAPI, spec: EPDDeploymentSpec, pools: Iterable[str]
    ) -> list[SloAlarm]:
        """The alarms of this pass for the plan whose pools are ``pools``."""
        queues = plan_queues(router.waiting() or {}, set(pools))
        earlier = list(self.earlier)
        self.earlier.append(queues)
        trace = router.trace_window(2 * self.window_s)
        if trace is None:
            return []
        slo = spec.slo.to_slo()
        return slo_alarms(trace.records, trace.span_s, slo, self.window_s, queues, earlier)


def plan_queues(table: dict[str, tuple[str, int, int]], pools: set[str]) -> Queues:
    """Waiting requests per instance of each role, over the plan's pools only."""
    out: dict[Role, float] = {}
    for name, (role, instances, waiting) in table.items():
        if name in pools and instances:
            out[Role(role)] = waiting / instances
    return out
