"""The simulator's fast scheduler path simulates exactly what the engine's scheduler would.

``SimScheduler`` rewrites the engine's ``schedule`` / ``update`` for speed (no per-token task
or event objects). These tests run whole simulations through it and through
``EngineScheduler`` (the engine's own code, step by step) on random traces and require the
same result to the last float: tokens, their times, errors, stage seconds, early stops, steps.
"""

from __future__ import annotations

import dataclasses

import pytest

from epd_engine.config import SLO, Method, Role
from epd_engine.contracts.plan import Plan
from epd_engine.contracts.trace import TraceRecord
from epd_engine.profiler.cost_model import FittedCostModel
from epd_engine.profiler.reference import reference_cost_model
from epd_engine.profiler.sim_scheduler import EngineScheduler, SimOutput, SimScheduler
from epd_engine.profiler.simulator import SimResult, Simulator
from epd_engine.request import Request
from epd_engine.workload.arrivals import ArrivalSpec
from epd_engine.workload.distributions import SizeChoice, Uniform
from epd_engine.workload.generators import WorkloadShape, synthesize
from tests.engine.profiler.factories import assert_same_simulation

# Issue 19's mixed traffic with shorter prompts and outputs (a test must stay cheap).
MIXED = WorkloadShape(
    "fast-path-mixed",
    "0-3 images, prompts 20-300, outputs 2-80",
    "tests",
    prompt_tokens=Uniform(20, 300),
    output_tokens=Uniform(2, 80),
    image_sizes=SizeChoice([(336, 336), (640, 480), (1024, 768)]),
    images_per_request=Uniform(0, 3),
)
SLO_MIXED = SLO(ttft_s=0.5, tpot_s=0.04)
PLANS = [
    Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 1, Role.D: 2}),
    Plan(method=Method.EP_D, pools={Role.EP: 2, Role.D: 1}),
    Plan(method=Method.ED_P, pools={Role.ED: 2, Role.P: 1}),
    Plan(method=Method.E_PD, pools={Role.E: 1, Role.PD: 2}),
    Plan(method=Method.EPD, pools={Role.EPD: 2}),
]


class CountingPreemptions(SimScheduler):
    """The fast path, counting preemptions (so a test knows it exercised them)."""

    preempted = 0

    def _preempt(self, request: Request, out: SimOutput) -> None:  # type: ignore[override]
        CountingPreemptions.preempted += 1
        super()._preempt(request, out)


def _run(
    plan: Plan,
    trace: list[TraceRecord],
    cost: FittedCostModel,
    kind: type[SimScheduler],
    stop: bool,
) -> SimResult:
    return Simulator(plan, cost, SLO_MIXED, scheduler_kind=kind).run(trace, stop_on_failure=stop)


def _small_kv(cost: FittedCostModel, num_kv_blocks: int) -> FittedCostModel:
    return dataclasses.replace(
        cost, capacity=dataclasses.replace(cost.capacity, num_kv_blocks=num_kv_blocks)
    )


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.describe())
def test_fast_path_simulates_exactly_like_the_engine_scheduler(plan: Plan, seed: int) -> None:
    """Random mixed traces at a rate that queues: every token at the same time as the
    engine scheduler's step-by-step simulation, run to the end."""
    trace = synthesize(MIXED, 80, ArrivalSpec("poisson", 40.0), seed=seed)
    cost = reference_cost_model()
    fast = _run(plan, trace, cost, SimScheduler, stop=False)
    reference = _run(plan, trace, cost, EngineScheduler, stop=False)
    assert sum(r.num_output_tokens for r in reference.results) > 1000  # decodes were run
    assert_same_simulation(fast, reference)


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.describe())
def test_fast_path_preempts_and_evicts_like_the_engine_scheduler(plan: Plan) -> None:
    """Too few KV pages: decodes grow into pages others hold, requests are preempted
    (recomputed, or evicted on a decode-only instance) in the engine's order."""
    trace = synthesize(MIXED, 60, ArrivalSpec("poisson", 60.0), seed=7)
    cost = _small_kv(reference_cost_model(), num_kv_blocks=64)
    CountingPreemptions.preempted = 0
    fast = _run(plan, trace, cost, CountingPreemptions, stop=False)
    assert CountingPreemptions.preempted > 0
    assert_same_simulation(fast, _run(plan, trace, cost, EngineScheduler, stop=False))


@pytest.mark.parametrize("plan", PLANS[::2], ids=lambda p: p.describe())
def test_fast_path_stops_early_at_the_same_event(plan: Plan) -> None:
    """Overload with ``stop_on_failure`` (what the plan search runs): same verdict, stopped
    at the same event with the same partial results."""
    trace = synthesize(MIXED, 120, ArrivalSpec("poisson", 400.0), seed=4)
    cost = reference_cost_model()
    fast = _run(plan, trace, cost, SimScheduler, stop=True)
    assert fast.stopped_early
    assert_same_simulation(fast, _run(plan, trace, cost, EngineScheduler, stop=True))


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.describe())
def test_fast_path_matches_the_engine_scheduler_on_variable_image_tokens(plan: Plan) -> None:
    """Qwen2-VL-sized images (a few dozen to ~1000 tokens, 64-token cache pages): the image
    budget is spent in tokens, so iterations hold different numbers of images."""
    trace = synthesize(MIXED, 60, ArrivalSpec("poisson", 40.0), seed=5, image_tokenizer="qwen2-vl")
    assert len({image.tokens for r in trace for image in r.images}) == 3  # 144, 391, 999
    cost = reference_cost_model()
    capacity = dataclasses.replace(cost.capacity, image_block_tokens=64, num_image_blocks=2304)
    cost = dataclasses.replace(cost, capacity=capacity)
    fast = _run(plan, trace, cost, SimScheduler, stop=False)
    reference = _run(plan, trace, cost, EngineScheduler, stop=False)
    assert_same_simulation(fast, reference)


@pytest.mark.parametrize("num_kv_blocks", [64, 2048])
@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.describe())
def test_fast_path_caches_prefixes_like_the_engine_scheduler(
    plan: Plan, num_kv_blocks: int
) -> None:
    """A trace with shared-prefix blocks (``sim_prefix.py``): the fast path registers, finds
    and evicts cached pages as the engine scheduler does, with few pages and with many."""
    trace = [
        record.model_copy(update={"hash_ids": (index % 5, index % 3)})
        for index, record in enumerate(synthesize(MIXED, 60, ArrivalSpec("poisson", 40.0), seed=5))
    ]
    cost = _small_kv(reference_cost_model(), num_kv_blocks)
    fast = _run(plan, trace, cost, SimScheduler, stop=False)
    reference = _run(plan, trace, cost, EngineScheduler, stop=False)
    assert sum(reference.prefix_hit_tokens.values()) > 0
    assert fast.prefix_hit_tokens == reference.prefix_hit_tokens
    assert fast.prefix_queried_tokens == reference.prefix_queried_tokens
    assert_same_simulation(fast, reference)


@pytest.mark.parametrize("plan", PLANS[::2], ids=lambda p: p.describe())
def test_fast_path_writes_answers_like_the_engine_scheduler(plan: Plan) -> None:
    """Six conversations of four turns (``sim_turns.py``): each turn generates its next
    turn's ids, so the next finds the answer's pages, on both paths alike."""
    sessions, turns, block = 6, 4, 512
    trace = [
        record.model_copy(update={
            "images": (), "session_id": f"s{index % sessions}", "hash_block_tokens": block,
            "prompt_tokens": (index // sessions + 1) * block + 30,
            "hash_ids": tuple(100 * (index % sessions) + k for k in range(index // sessions + 1)),
        })
        for index, record in enumerate(
            synthesize(MIXED, sessions * turns, ArrivalSpec("poisson", 4.0), seed=8)
        )
    ]  # fmt: skip
    cost = reference_cost_model()
    fast = _run(plan, trace, cost, SimScheduler, stop=False)
    reference = _run(plan, trace, cost, EngineScheduler, stop=False)
    earlier_blocks = sessions * block * sum(range(turns))
    assert max(reference.prefix_hit_tokens.values()) > earlier_blocks  # answers' pages too
    assert fast.prefix_hit_tokens == reference.prefix_hit_tokens
    assert_same_simulation(fast, reference)
