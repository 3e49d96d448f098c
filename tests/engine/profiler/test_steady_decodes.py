"""The steady cohort (``steady_decodes.py``) simulates exactly what walking every decode does.

Plain decodes advance as one cohort per instance (O(1) an iteration) and are written back
when they leave it. These tests run the same simulations with the cohort and with
``steady_decodes=False`` (every request walked every iteration, the path
``test_sim_fast_path.py`` holds to the engine's scheduler) and require the same result to
the last float, including where the cohort must dissolve (pages short) and where late
gaps stop a run early (the plan search's verdict).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from epd_engine.config import SLO, Method, Role
from epd_engine.contracts.plan import Budgets, Plan
from epd_engine.contracts.trace import TraceRecord
from epd_engine.profiler.cost_model import FittedCostModel
from epd_engine.profiler.reference import reference_cost_model
from epd_engine.profiler.simulator import SimResult, Simulator
from epd_engine.profiler.steady_decodes import Run, SteadyDecodes
from epd_engine.workload.arrivals import ArrivalSpec
from epd_engine.workload.distributions import SizeChoice, Uniform
from epd_engine.workload.generators import WorkloadShape, synthesize
from tests.engine.profiler.factories import assert_same_simulation

LONG_ANSWERS = WorkloadShape(
    "steady-long-answers",
    "0-2 images, prompts 20-300, outputs 20-200",
    "tests",
    prompt_tokens=Uniform(20, 300),
    output_tokens=Uniform(20, 200),
    image_sizes=SizeChoice([(336, 336), (640, 480)]),
    images_per_request=Uniform(0, 2),
)
PLANS = [
    Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 1, Role.D: 2}),
    Plan(method=Method.ED_P, pools={Role.ED: 2, Role.P: 1}),
    Plan(method=Method.EPD, pools={Role.EPD: 2}),
]


@dataclasses.dataclass
class Counts:
    joined: int = 0
    dissolved: int = 0  # dissolves of a cohort that had members
    steady_tokens: int = 0


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counts]:
    """Counts what the cohort did, so a test knows it exercised it."""
    seen = Counts()
    join, dissolve, leave = SteadyDecodes.join, SteadyDecodes.dissolve, SteadyDecodes.leave

    def counted_join(self: SteadyDecodes, request: object) -> None:
        seen.joined += 1
        join(self, request)  # type: ignore[arg-type]

    def counted_dissolve(self: SteadyDecodes, runs: list[Run]) -> None:
        seen.dissolved += bool(self.members)
        dissolve(self, runs)

    def counted_leave(self: SteadyDecodes, member: object, runs: list[Run]) -> object:
        before = len(runs)
        request = leave(self, member, runs)  # type: ignore[arg-type]
        seen.steady_tokens += sum(run.count for run in runs[before:])
        return request

    monkeypatch.setattr(SteadyDecodes, "join", counted_join)
    monkeypatch.setattr(SteadyDecodes, "dissolve", counted_dissolve)
    monkeypatch.setattr(SteadyDecodes, "leave", counted_leave)
    yield seen


def _run(
    plan: Plan,
    trace: list[TraceRecord],
    cost: FittedCostModel,
    slo: SLO,
    steady: bool,
    stop: bool,
) -> SimResult:
    simulator = Simulator(plan, cost, slo, steady_decodes=steady)
    return simulator.run(trace, stop_on_failure=stop)


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.describe())
def test_the_cohort_carries_most_tokens_and_changes_nothing(plan: Plan, counts: Counts) -> None:
    trace = synthesize(LONG_ANSWERS, 80, ArrivalSpec("poisson", 20.0), seed=3)
    cost = reference_cost_model()
    slo = SLO(ttft_s=0.5, tpot_s=0.04)
    steady = _run(plan, trace, cost, slo, steady=True, stop=False)
    walked = _run(plan, trace, cost, slo, steady=False, stop=False)
    tokens = sum(r.num_output_tokens for r in walked.results)
    assert counts.joined > 40
    assert counts.steady_tokens > tokens / 2  # most decode tokens never walked one by one
    assert_same_simulation(steady, walked)


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.describe())
def test_the_cohort_dissolves_when_pages_run_short(plan: Plan, counts: Counts) -> None:
    """Few KV pages: the cohort gives way to the engine's page order and preemptions."""
    trace = synthesize(LONG_ANSWERS, 60, ArrivalSpec("poisson", 40.0), seed=7)
    cost = reference_cost_model()
    cost = dataclasses.replace(cost, capacity=dataclasses.replace(cost.capacity, num_kv_blocks=96))
    slo = SLO(ttft_s=0.5, tpot_s=0.04)
    steady = _run(plan, trace, cost, slo, steady=True, stop=False)
    assert counts.dissolved > 0
    assert_same_simulation(steady, _run(plan, trace, cost, slo, steady=False, stop=False))


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.describe())
def test_late_gaps_stop_the_run_at_the_same_event(plan: Plan, counts: Counts) -> None:
    """A TPOT SLO tighter than a decode step once batches grow (budgets set wide, a TTFT
    SLO nobody misses): requests miss on late gaps counted while they are steady, and the
    run stops at the event the walk stops at."""
    trace = synthesize(LONG_ANSWERS, 120, ArrivalSpec("poisson", 30.0), seed=4)
    cost = reference_cost_model()
    wide = Budgets(image_budget=4, token_budget=2048)
    plan = plan.model_copy(update={"budgets": dict.fromkeys(plan.method.roles, wide)})
    slo = SLO(ttft_s=60.0, tpot_s=0.015)
    steady = _run(plan, trace, cost, slo, steady=True, stop=True)
    assert steady.stopped_early
    assert counts.joined > 0
    assert_same_simulation(steady, _run(plan, trace, cost, slo, steady=False, stop=True))


def test_silent_tokens_keep_every_decode_walked(counts: Counts) -> None:
    """With silent tokens a gap spans several iterations at random: no cohort."""
    trace = synthesize(LONG_ANSWERS, 30, ArrivalSpec("poisson", 20.0), seed=1)
    cost = reference_cost_model()
    cost = dataclasses.replace(
        cost, overheads=dataclasses.replace(cost.overheads, silent_tokens=0.2)
    )
    _run(PLANS[0], trace, cost, SLO(ttft_s=0.5, tpot_s=0.04), steady=True, stop=False)
    assert counts.joined == 0
