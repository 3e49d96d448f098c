"""Which plan, this pass: the decide half of the reconcile loop, for both backends.

The operator (``controller.reconcile``, pools as Deployments) and local mode
(``local_reconciler.LocalReconciler``, pools as processes) call ``plan_pass`` with what
their status remembers (``PlanMemory``) and a way to read the live workload; it reads the
workload only when a re-plan may be due (``loop.replan_due``), runs ``loop.choose_plan``
(hysteresis, cooldown, failed search keeps the plan) and returns the plan to roll out and
what to remember. The rollout itself is ``rollout_driver.rollout_pass``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime

from epd_engine.contracts.plan import Plan
from epd_engine.contracts.trace import TraceRecord
from epd_operator.api.conditions import ConditionState
from epd_operator.api.decision_status import PlanDecision
from epd_operator.api.spec import EPDDeploymentSpec, PlanStatus, WorkloadSnapshot
from epd_operator.planning.alarm import SloAlarm
from epd_operator.planning.background_search import BackgroundSearch
from epd_operator.planning.choice import (
    PlanChoice,
    WorkloadStats,
    budget_changed,
    choose_plan,
    heuristic_planner,
    replan_due,
    same_plan,
)
from epd_operator.planning.decision import (
    FAST_SCALED_UP,
    decision_record,
    fast_decision_record,
)
from epd_operator.planning.fast_path import FastStep, can_grow, fast_step
from epd_operator.planning.forecast import Forecast, forecast_window, with_profile
from epd_operator.planning.horizon import rollout_horizon, switch_seconds
from epd_operator.planning.planner import (
    MAX_PLAN_REQUESTS,
    PLAN_TIMEOUT_S,
    CostSource,
    auto_planner,
    reference_cost,
)

PostEvent = Callable[[str, str, str], None]  # (type, reason, message)
# The trace window's records (None: unreadable) and the workload statistics (None: none).
ReadWorkload = Callable[[], tuple[Sequence[TraceRecord] | None, WorkloadStats | None]]
# The SLO alarms of the last scrape window (``alarm.slo_alarms`` on the router's trace).
ReadAlarms = Callable[[], Sequence[SloAlarm]]
# The daily profile's ratio for a horizon in seconds (``daily_profile``); None: no history
ReadProfile = Callable[[float], float | None]
# The fast path's scrape window: the operator's resync (a pass every 10 s when idle).
ALARM_WINDOW_S = 10.0


def no_alarms() -> Sequence[SloAlarm]:
    return ()


def _milli(x: float | None) -> int | None:
    return None if x is None else round(x * 1000)


def snapshot(stats: WorkloadStats) -> WorkloadSnapshot:
    return WorkloadSnapshot(
        num_requests=stats.num_requests,
        request_rate_milli_rps=round(stats.request_rate_rps * 1000),
        mean_prompt_tokens=None
        if stats.mean_prompt_tokens is None
        else round(stats.mean_prompt_tokens),
        mean_images_milli=_milli(stats.mean_images),
        mean_output_tokens=None
        if stats.mean_output_tokens is None
        else round(stats.mean_output_tokens),
    )


def from_snapshot(snap: WorkloadSnapshot) -> WorkloadStats:
    return WorkloadStats(
        num_requests=snap.num_requests,
        request_rate_rps=snap.request_rate_milli_rps / 1000,
        mean_prompt_tokens=snap.mean_prompt_tokens,
        mean_images=None if snap.mean_images_milli is None else snap.mean_images_milli / 1000,
        mean_output_tokens=snap.mean_output_tokens,
    )


@dataclass(frozen=True)
class PlanMemory:
    """What the status remembers about plans between passes."""

    plan: PlanStatus | None = None
    last_planned: datetime | None = None
    last_change: datetime | None = None
    planned_on: WorkloadSnapshot | None = None  # the workload the plan was made on
    last_switch_s: float | None = None  # decision to serving, of the last switch measured
    decision: PlanDecision | None = None  # why the last re-plan decided what it did


@dataclass(frozen=True)
class Searched:
    """A re-plan's outcome with what it was made on (run in the pass or beside it)."""

    choice: PlanChoice
    stats: WorkloadStats | None
    forecast: Forecast | None
    planner_s: float


@dataclass(frozen=True)
class PlanPassResult:
    plan: Plan  # to roll out (as the status records it, so every pass renders the same)
    memory: PlanMemory
    note: ConditionState | None  # the ``Planned`` condition, when there is news
    planner_s: float | None  # the planner ran this long (None: it did not run)


def measure_switch(
    memory: PlanMemory,
    switched: bool,
    confirmed: Iterable[str],
    plan_pools: Iterable[str],
    now: datetime,
) -> PlanMemory:
    """``memory`` with the switch duration when this pass's rollout completed the plan (every
    router replica confirmed exactly its pools): the next forecast's horizon."""
    took = switch_seconds(switched, confirmed, plan_pools, memory.last_change, now)
    return memory if took is None else replace(memory, last_switch_s=took)


def with_forecast(
    spec: EPDDeploymentSpec,
    records: Sequence[TraceRecord] | None,
    stats: WorkloadStats | None,
    horizon_s: float,
    read_profile: ReadProfile | None = None,
) -> tuple[WorkloadStats | None, Forecast | None]:
    """``stats`` with the rate forecast for ``horizon_s`` past the window (an elastic plan is
    sized for it), and the forecast; unchanged without a trace window. ``read_profile``:
    the daily profile's ratio for a horizon (``daily_profile``), where there is history."""
    if records is None or stats is None or not stats.window_s:
        return stats, None
    hold_s = spec.capacity.scale_down_stabilization_seconds
    forecast = forecast_window([r.arrival_s for r in records], stats.window_s, horizon_s, hold_s)
    if read_profile is not None:
        forecast = with_profile(forecast, read_profile(horizon_s))
    return replace(stats, forecast_rps=forecast.forecast_rps), forecast


def plan_pass(
    spec: EPDDeploymentSpec,
    memory: PlanMemory,
    now: datetime,
    read_workload: ReadWorkload,
    post_event: PostEvent,
    cost_source: CostSource = reference_cost,
    plan_timeout_s: float = PLAN_TIMEOUT_S,
    plan_max_requests: int = MAX_PLAN_REQUESTS,
    same_host: bool = False,
    read_alarms: ReadAlarms = no_alarms,
    serving: bool = True,
    alarm_window_s: float = ALARM_WINDOW_S,
    search: BackgroundSearch[Searched] | None = None,
    read_profile: ReadProfile | None = None,
) -> PlanPassResult:
    """One pass's plan. ``cost_source`` names the cost model the profiler plans with (its
    label ends up in the plan's reason); ``same_host``: the pools are local processes.

    When the slow path (the re-plan) has no news this pass, the fast path reads the SLO
    alarms (``read_alarms``) and may add an instance to the bottleneck stage
    (``fast_path``): one step per re-plan (``_awaits_replan``), and only once the last
    change serves (``serving``: every router replica routes to the current plan's pools) and
    a scrape window (``alarm_window_s``) has passed since its switch, so that the alarm is
    about the current plan.

    With ``search``, a re-plan of a serving plan runs beside the passes (``background_search``):
    the pass that finds it due starts it and goes on with the current plan, and the first
    pass after it finished takes its choice. Without, it runs in the pass (tests, tools)."""

    def since(t: datetime | None) -> float:
        return (now - t).total_seconds() if t else float("inf")

    last_planned, last_change = memory.last_planned, memory.last_change
    since_plan = since(last_planned)
    planned_on = from_snapshot(memory.planned_on) if memory.planned_on else None
    horizon_s, horizon_source = rollout_horizon(memory.last_switch_s)

    def replan() -> Searched:
        """Read the window, forecast, and choose (the planner may run for minutes)."""
        records, stats = read_workload()
        stats, forecast = with_forecast(spec, records, stats, horizon_s, read_profile)
        planner = auto_planner(
            records,
            cost_source,
            timeout_s=plan_timeout_s,
            max_requests=plan_max_requests,
            same_host=same_host,
        )
        started = time.perf_counter()
        choice = choose_plan(
            spec, memory.plan, stats, planned_on, since_plan, planner, since(last_change)
        )
        return Searched(choice, stats, forecast, time.perf_counter() - started)

    searched: Searched | None = None
    if replan_due(spec, memory.plan, since_plan):  # Auto only; the window is read only then
        current = memory.plan
        if search is None or current is None or budget_changed(spec, current):
            searched = replan()  # in the pass: nothing serves yet, or the spec asks for it
        else:
            searched = search.take(current.revision)
            if searched is None:
                search.start(current.revision, replan)
    if searched is not None:
        choice, stats, forecast = searched.choice, searched.stats, searched.forecast
        planner_s = searched.planner_s if choice.ran else None
    else:  # no re-plan this pass: the current plan (Fixed: the spec's; none yet: heuristic)
        choice = choose_plan(
            spec, memory.plan, None, planned_on, since_plan, heuristic_planner, since(last_change)
        )
        stats, forecast, planner_s = None, None, None
    plan, plan_status, new_planned_on = choice.plan, memory.plan, memory.planned_on
    note, decision = choice.note, memory.decision
    step: FastStep | None = None
    if choice.ran or choice.note is not None:
        decision = decision_record(spec, now, choice.note, plan, stats, forecast, horizon_source)
    elif (
        serving
        and since(last_change) >= alarm_window_s + (memory.last_switch_s or 0.0)
        and not _awaits_replan(memory)
    ):
        step = _fast(spec, plan, read_alarms)
        if step is not None:  # the slow path keeps its schedule (last_planned)
            plan, decision = step.after, fast_decision_record(spec, now, step)
            note = ConditionState("True", FAST_SCALED_UP, step.after.reason)
            new_planned_on = None  # the next re-plan is due whatever the workload: it confirms
    if choice.ran:
        last_planned = now
        new_planned_on = snapshot(stats) if stats is not None else None
        if plan_status is not None and same_plan(plan_status.to_plan(), plan):
            # same pools: keep the revision, record the new reason and prediction
            plan_status = PlanStatus.from_plan(plan, plan_status.revision)
    if plan_status is None or not same_plan(plan_status.to_plan(), plan):
        revision = plan_status.revision + 1 if plan_status else 1
        before = plan_status.to_plan().describe() if plan_status else "none"
        plan_status = PlanStatus.from_plan(plan, revision)
        post_event(
            "Normal",
            "PlanChanged",
            f"Plan {before} -> {plan.describe()} (revision {revision}): {plan.reason}",
        )
        last_change = now
        if step is None:
            last_planned = now
    new = replace(
        memory,
        plan=plan_status,
        last_planned=last_planned,
        last_change=last_change,
        planned_on=new_planned_on,
        decision=decision,
    )
    return PlanPassResult(plan_status.to_plan(), new, note, planner_s)


def _awaits_replan(memory: PlanMemory) -> bool:
    """The fast path's last step waits for a re-plan to confirm or correct it: one step per
    re-plan. Each step changes the plan's revision, and a background search is taken only
    for the revision it started on, so a step every scrape window dropped every search that
    took longer: in a ``make bench-elastic`` run the fast path added 16 decode instances in
    3 minutes on TPOT misses they did not fix, and no re-plan landed."""
    return memory.decision is not None and memory.decision.outcome == FAST_SCALED_UP


def _fast(spec: EPDDeploymentSpec, plan: Plan, read_alarms: ReadAlarms) -> FastStep | None:
    """The fast path's step; the alarms are read only when a step could be taken."""
    return fast_step(spec, plan, read_alarms()) if can_grow(spec, plan) else None
