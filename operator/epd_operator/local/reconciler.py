"""The reconcile loop on local processes: what ``epdctl up`` runs for ``mode: Auto`` (or
``--reconcile``), and what ``epdctl apply`` changes at run time.

One pass is the operator's (``controller.reconcile``) with the other backend: the plan
comes from ``plan_pass.plan_pass`` (the router's trace window, ``loop.choose_plan`` with its
hysteresis and cooldown; a re-plan runs beside the passes, ``background_search``), the pools
are ``epdctl serve`` processes (``LocalPools``) and the rollout is
``rollout_driver.rollout_pass`` against the local router: new pools first, the routing
switched and read back, old pools drained, then stopped. The profiler plans with
``cost_source`` (``epdctl up --cost-model FILE``, see ``cost_file``; else the built-in
reference), over the ``shm`` link ``auto`` transfers use between processes of one host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from epd_engine.config import Role
from epd_engine.contracts.trace import TraceRecord
from epd_operator.api.spec import EPDDeploymentSpec
from epd_operator.local.pools import LocalEngines, LocalPools
from epd_operator.planning.alarm import SloAlarm
from epd_operator.planning.background_search import BackgroundSearch
from epd_operator.planning.choice import WorkloadStats
from epd_operator.planning.offered import offered
from epd_operator.planning.plan_pass import (
    ALARM_WINDOW_S,
    PlanMemory,
    Searched,
    measure_switch,
    plan_pass,
)
from epd_operator.planning.planner import (
    MAX_PLAN_REQUESTS,
    PLAN_TIMEOUT_S,
    CostSource,
    reference_cost,
    workload_stats,
)
from epd_operator.rollout.alarm_reader import AlarmReader
from epd_operator.rollout.decision_report import pass_decision, post_decision
from epd_operator.rollout.driver import RolloutState, rollout_pass
from epd_operator.rollout.loop_metrics import LoopMetrics, LoopTarget
from epd_operator.rollout.pool_identity import Owner, pool_specs
from epd_operator.rollout.router_api import RouterAPI
from epd_operator.rollout.router_fleet import RouterFleet
from epd_operator.rollout.serve_settings import engine_settings

PostEvent = Callable[[str, str, str], None]  # (type, reason, message)


def engine_args(spec: EPDDeploymentSpec) -> tuple[str, ...]:
    """What every local engine process of ``spec`` gets (``epdctl serve`` flags)."""
    return (*engine_settings(spec), *spec.engine.extra_args)


def uses_tensor_parallel(spec: EPDDeploymentSpec) -> bool:
    """Whether a plan of ``spec`` may split an instance over ranks (Fixed: a role's
    tensorParallelSize; Auto: a size the profiler may choose)."""
    fixed = any(spec.engine.roles.tensor_parallel_size(role) > 1 for role in Role)
    return fixed or any(size > 1 for size in spec.disaggregation.tensor_parallel_sizes)


@dataclass
class LocalStatus:
    """One pass's outcome, as ``epdctl status`` and the state file show it."""

    plan: str  # e.g. "E+P+D 1E1P1D"
    revision: int
    reason: str  # why this plan
    phase: str  # the Progressing reason: RolloutComplete, WaitingForPools, Draining, ...
    conditions: dict[str, tuple[str, str, str]]  # type -> (status, reason, message)
    active_pools: list[str]
    pools: dict[str, dict[str, Any]] = field(default_factory=dict)
    cost_model: str = ""  # what the profiler plans with (``cost_file.describe``)
    decision: dict[str, Any] | None = None  # why the last re-plan decided (``PlanDecision``)

    @property
    def complete(self) -> bool:
        return self.phase == "RolloutComplete"

    def to_json(self) -> dict[str, Any]:
        return {
            "plan": self.plan,
            "revision": self.revision,
            "reason": self.reason,
            "phase": self.phase,
            "conditions": {k: list(v) for k, v in self.conditions.items()},
            "active_pools": self.active_pools,
            "pools": self.pools,
            "cost_model": self.cost_model,
            "decision": self.decision,
        }


class LocalReconciler:
    def __init__(
        self,
        name: str,
        engines: LocalEngines,
        post_event: PostEvent,
        router_timeout_s: float = 2.0,
        plan_timeout_s: float = PLAN_TIMEOUT_S,
        plan_max_requests: int = MAX_PLAN_REQUESTS,
        cost_source: CostSource = reference_cost,
        alarm_window_s: float = ALARM_WINDOW_S,
        metrics: LoopMetrics | None = None,
        served_model: str = "",
    ) -> None:
        """``cost_source`` is called once here for its label (a local source is a file read
        at start or the reference: it does not fail) and again by each profiler run;
        ``alarm_window_s``: the fast path's scrape window. ``metrics``: each pass recorded
        there, labelled ``served_model`` (default: the engines' model name)."""
        self.name = name
        self.engines = engines
        self.pools = LocalPools(engines)
        self.router = RouterAPI(engines.router_url, engines.token, router_timeout_s)
        self.fleet = RouterFleet(engines.replica_urls, engines.token, router_timeout_s)
        self.post_event = post_event
        self.plan_timeout_s = plan_timeout_s
        self.plan_max_requests = plan_max_requests
        self.cost_source = cost_source
        self.cost_label = cost_source()[1]
        self.alarms = AlarmReader(alarm_window_s)
        self.memory = PlanMemory()
        self.search: BackgroundSearch[Searched] = BackgroundSearch()  # re-plans beside passes
        self.state = RolloutState()
        self.planned: tuple[str, str, str] | None = None  # the last Planned note (Auto)
        self.metrics = metrics
        self.who = LoopTarget("local", name, served_model or engines.model_name)

    def reconcile(self, spec: EPDDeploymentSpec, now: datetime) -> LocalStatus:
        # a changed spec starts new pools with its engine flags (their names change too)
        self.pools.engines = replace(self.engines, engine_args=engine_args(spec))

        def read_workload() -> tuple[Sequence[TraceRecord] | None, WorkloadStats | None]:
            trace = self.router.trace_window(spec.profiler.trace_window_seconds, in_flight=True)
            if trace is None:
                return None, None
            records = offered(trace.records)
            stats = workload_stats(records, trace.span_s, spec.slo.to_slo())
            return records, stats

        owner = Owner(name=self.name, namespace="local", uid="local", spec=spec)
        current = self.memory.plan
        current_pools = (
            frozenset(p.name for p in pool_specs(owner, current.to_plan())) if current else None
        )

        def read_alarms() -> Sequence[SloAlarm]:
            return self.alarms.read(self.router, spec, current_pools or ())

        passed = plan_pass(
            spec,
            self.memory,
            now,
            read_workload,
            self.post_event,
            plan_timeout_s=self.plan_timeout_s,
            plan_max_requests=self.plan_max_requests,
            cost_source=self.cost_source,
            same_host=True,  # every pool is a process on this host
            read_alarms=read_alarms,
            serving=self.state.active_pools == current_pools,
            alarm_window_s=self.alarms.window_s,
            search=self.search,
        )
        self.memory = passed.memory
        plan = passed.plan
        decided = pass_decision(passed)
        if decided is not None:
            post_decision(self.post_event, decided)
        desired = pool_specs(owner, plan)
        outcome = rollout_pass(
            self.pools,
            self.fleet,
            desired,
            plan,
            self.state,
            now,
            spec.gpu_budget,
            spec.rollout.drain_timeout_seconds,
            self.post_event,
        )
        self.state = outcome.state
        self.memory = measure_switch(
            self.memory, outcome.switched, self.state.active_pools, (p.name for p in desired), now
        )
        if self.metrics is not None:
            self.metrics.record_pass(
                self.who, spec, outcome.status.pools, self.memory.decision, decided is not None
            )
        conditions = {
            k: (c.status, c.reason, c.message) for k, c in outcome.status.conditions.items()
        }
        if passed.note is not None:
            self.planned = (passed.note.status, passed.note.reason, passed.note.message)
        if self.planned is not None and spec.disaggregation.mode == "Auto":
            conditions["Planned"] = self.planned  # the last decision, as the operator keeps it
        assert self.memory.plan is not None
        return LocalStatus(
            plan=plan.describe(),
            revision=self.memory.plan.revision,
            reason=plan.reason,
            phase=conditions["Progressing"][1],
            conditions=conditions,
            active_pools=sorted(self.state.active_pools),
            pools=self._pool_status(),
            cost_model=self.cost_label,
            decision=None
            if self.memory.decision is None
            else self.memory.decision.model_dump(mode="json", by_alias=True),
        )

    def _pool_status(self) -> dict[str, dict[str, object]]:
        """Each pool's role, replicas and Ready ones, and those a resize removed that still
        drain (``leaving``: they hold their GPU until they exit)."""
        observed = self.pools.observe_pools()
        leaving = self.pools.leaving_by_pool()
        return {
            p.name: {"role": p.role.value, "replicas": p.replicas, "ready": p.ready,
                     "leaving": leaving.get(p.name, 0)}
            for p in observed.values()
        }  # fmt: skip

    def restart_dead(self) -> list[str]:
        return self.pools.restart_dead()

    def pids(self) -> list[int]:
        return self.pools.pids()

    def instances(self) -> list[dict[str, object]]:
        return self.pools.instances()

    def stop(self) -> None:
        self.pools.stop_all()
