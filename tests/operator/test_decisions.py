"""Auto mode's decisions do not flap: margin over the current plan re-simulated on the same
window, cooldown, a failed search keeps the plan, and text-only traffic gets no E pool."""

from __future__ import annotations

from typing import Any

import pytest

from epd_engine.config import Method, Role
from epd_engine.contracts.plan import Plan, Prediction
from epd_engine.contracts.trace import TraceRecord
from epd_engine.profiler.reference import reference_cost_model
from epd_operator.api.spec import EPDDeploymentSpec, PlanStatus
from epd_operator.planning.choice import (
    PlanningError,
    Proposal,
    WorkloadStats,
    choose_plan,
    heuristic_plan,
)
from epd_operator.planning.planner import auto_planner, profiler_proposal, workload_stats
from tests.operator.test_planner import auto_spec, trace

CURRENT = Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 2, Role.D: 1})
BETTER = Plan(method=Method.EP_D, pools={Role.EP: 2, Role.D: 2})
STATS = WorkloadStats(500, 2.0, 100.0, 1.0, 50.0)
SHIFTED = WorkloadStats(500, 2.0, 100.0, 3.0, 50.0)


def spec(**profiler: Any) -> EPDDeploymentSpec:
    return auto_spec(gpuBudget=4, profiler={"minRequests": 100, **profiler})


def offering(goodput_rps: float, current_rps: float) -> Any:
    """A planner that proposes BETTER at ``goodput_rps`` and re-simulates the current plan at
    ``current_rps`` (the decision rule is under test here, not the search)."""

    def planner(*_: Any) -> Proposal:
        plan = BETTER.model_copy(
            update={"predicted": Prediction(goodput_rps=goodput_rps, ttft_p90_s=1, tpot_p90_s=0.05)}
        )
        return Proposal(plan, current_rps)

    return planner


def decide(s: EPDDeploymentSpec, planner: Any, since_change: float = 10_000) -> Any:
    current = PlanStatus.from_plan(CURRENT, 1)
    return choose_plan(s, current, SHIFTED, STATS, 10_000, planner, since_change)


def test_a_new_plan_must_beat_the_current_one_by_the_margin() -> None:
    s = spec(switchMarginPercent=10)
    kept = decide(s, offering(10.5, 10.0))
    assert kept.ran and kept.plan.describe() == CURRENT.describe()
    assert kept.note is not None and kept.note.reason == "KeptCurrentPlan"
    assert "10.5 rps" in kept.note.message and "not 10% better" in kept.note.message
    switched = decide(s, offering(11.5, 10.0))
    assert switched.plan.describe() == BETTER.describe()
    assert switched.note is not None and switched.note.reason == "Replanned"


def test_no_switch_during_the_cooldown() -> None:
    s = spec(cooldownSeconds=600)
    choice = decide(s, offering(100.0, 1.0), since_change=120)
    assert not choice.ran and choice.plan.describe() == CURRENT.describe()
    assert choice.note is not None and choice.note.reason == "Cooldown"
    assert "480 s left" in choice.note.message


def test_failed_search_keeps_the_current_plan_and_says_so() -> None:
    """Defect: a failed or timed-out search replaced a profiler plan with the heuristic."""

    def broken() -> Any:
        raise ValueError("ConfigMap serving/costs not found")

    records = trace("textvqa", 150)
    choice = decide(spec(), auto_planner(records, broken))
    assert choice.plan.describe() == CURRENT.describe()
    assert choice.note is not None
    assert (choice.note.status, choice.note.reason) == ("False", "SearchFailed")
    assert "ConfigMap serving/costs not found" in choice.note.message

    def raising(*_: Any) -> Proposal:
        raise PlanningError("the plan search took longer than 60 s")

    timed_out = decide(spec(), raising)
    assert timed_out.plan.describe() == CURRENT.describe()
    assert timed_out.note is not None and "longer than 60 s" in timed_out.note.message


@pytest.mark.parametrize("budget", [1, 2, 3, 4, 8, 16])
def test_text_only_traffic_gets_no_e_pool_from_the_heuristic_either(budget: int) -> None:
    """Defect: the heuristic gave E+P+D with an E pool even for text-only traffic."""
    s = auto_spec(gpuBudget=budget)
    text_only = WorkloadStats(300, 2.0, mean_prompt_tokens=400.0, mean_images=0.0,
                              mean_output_tokens=100.0)  # fmt: skip
    plan = heuristic_plan(s, text_only)
    assert Role.E not in plan.pools, plan.describe()
    assert plan.num_instances == budget


def _windows(shape: Any, seeds: range, **kw: Any) -> list[list[TraceRecord]]:
    return [trace(shape, 200, seed=seed, **kw) for seed in seeds]


@pytest.mark.slow
def test_stationary_workload_never_switches_and_a_shift_switches_exactly_once() -> None:
    """The real profiler (in this process) re-plans at every interval (shift threshold 1%):
    three windows of the same text-heavy mix, then three of an image-heavy one. Fresh samples
    of one workload differ a little; only the shift may change the plan, and only once.
    (The same mix with every request carrying images is the image-heavy phase.)"""
    s = spec(shiftThresholdPercent=1, cooldownSeconds=300, switchMarginPercent=10)
    interval_s = s.profiler.interval_seconds
    cost = reference_cost_model()
    light = _windows("visualwebinstruct", range(3), text_only_fraction=0.9)
    heavy = _windows("visualwebinstruct", range(3, 6), text_only_fraction=0.0)
    current: PlanStatus | None = None
    planned_on = None
    since_change = float("inf")
    changes, notes = [], []
    for window in light + heavy:
        since_change += interval_s  # one interval between passes
        stats = workload_stats(window, 40.0)

        def planner(sp: EPDDeploymentSpec, st: Any, cur: Plan | None, w: Any = window) -> Proposal:
            return profiler_proposal(sp, w, cost, current=cur)

        choice = choose_plan(s, current, stats, planned_on, interval_s, planner, since_change)
        notes.append(choice.note.reason if choice.note else "NotDue")
        if choice.ran:
            planned_on = stats
        if current is None or choice.plan.describe() != current.to_plan().describe():
            if current is not None:
                changes.append((current.to_plan().describe(), choice.plan.describe()))
            current = PlanStatus.from_plan(choice.plan, 1)
            since_change = 0.0
    assert notes[0] == "Planned" and notes[3] == "Replanned", notes
    assert set(notes[1:3] + notes[4:]) <= {"PlanConfirmed", "KeptCurrentPlan"}, notes
    assert len(changes) == 1, changes
