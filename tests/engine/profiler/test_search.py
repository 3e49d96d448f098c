from __future__ import annotations

from math import comb

import pytest

from epd_engine.config import SLO, Method, Role, Stage
from epd_engine.contracts.plan import Plan
from epd_engine.profiler.candidates import (
    Candidate,
    compositions,
    enumerate_candidates,
    proportional_split,
)
from epd_engine.profiler.evaluate import Evaluator
from epd_engine.profiler.search import (
    format_table,
    plan_from_search,
    search_plans,
    table_rows,
)

from .factories import make_trace, toy_cost_model


def test_search_space_has_hydrainfers_ratio_counts() -> None:
    n = 8
    candidates = enumerate_candidates(n)
    by_method = {m: [c for c in candidates if c.method is m] for m in Method}
    assert len(by_method[Method.E_P_D]) == comb(n - 1, 2)
    for method in (Method.EP_D, Method.ED_P, Method.E_PD):
        assert len(by_method[method]) == comb(n - 1, 1)
    assert [c.counts for c in by_method[Method.EPD]] == [(8,)]
    assert all(c.num_instances == n and min(c.counts) >= 1 for c in candidates)
    assert list(compositions(2, 3)) == []


def test_proportional_split_gives_each_pool_one_then_shares() -> None:
    assert proportional_split(8, [1.0, 3.0, 4.0]) == (1, 3, 4)
    assert proportional_split(3, [0.0, 5.0, 0.0]) == (1, 1, 1)
    assert sum(proportional_split(32, [0.2, 1.7, 0.9]) or ()) == 32
    assert proportional_split(2, [1.0, 1.0, 1.0]) is None


def _encode_gpus(plan: Plan) -> int:
    return sum(n for role, n in plan.pools.items() if role.runs(Stage.ENCODE))


def test_text_only_traffic_never_gets_an_encode_pool() -> None:
    trace = make_trace(num=120, rate_rps=20, images_per_request=0, output_tokens=3)
    slo = SLO(ttft_s=0.5, tpot_s=0.05)
    evaluator, exhaustive, _ = search_plans(
        trace, toy_cost_model(), slo, 5, with_heuristic=False, show_progress=False
    )
    plan = plan_from_search(evaluator, exhaustive, None, slo)
    assert plan is not None
    assert Role.E not in plan.pools, plan.describe()
    dedicated = [e for e in exhaustive.ranked() if Role.E in e.candidate.pools]
    best = exhaustive.best
    assert best is not None and best.goodput_rps
    assert all((e.goodput_rps or e.below_rps or 0) <= best.goodput_rps * 1.05 for e in dedicated)


def test_image_heavy_traffic_under_a_tight_ttft_gets_more_encode_capacity() -> None:
    cost = toy_cost_model(encode_per_image_s=0.01, prefill_per_token_s=5e-5)
    slo = SLO(ttft_s=0.25, tpot_s=0.05)
    light = make_trace(150, 20.0, 400, images_per_request=1, output_tokens=3)  # E 10, P 25 ms
    heavy = make_trace(150, 20.0, 400, images_per_request=4, output_tokens=3)  # E 40, P 40 ms
    chosen = {}
    for name, trace in (("light", light), ("heavy", heavy)):
        evaluator, exhaustive, _ = search_plans(
            trace, cost, slo, 8, methods=[Method.E_P_D], with_heuristic=False, show_progress=False
        )
        plan = plan_from_search(evaluator, exhaustive, None, slo)
        assert plan is not None, name
        chosen[name] = plan
    assert chosen["heavy"].pools[Role.E] > chosen["light"].pools[Role.E], chosen


def test_large_images_get_more_encode_capacity_than_small_ones() -> None:
    """A resolution-dependent model (Qwen2-VL: ``tokens_per_image`` unset) is charged each
    image's trace tokens: one 400-token image per request needs more E than one of 100."""
    cost = toy_cost_model(encode_per_image_s=0.01, prefill_per_token_s=5e-5)
    assert cost.capacity.tokens_per_image is None
    slo = SLO(ttft_s=0.25, tpot_s=0.05)
    small = make_trace(150, 20.0, 400, image_tokens=100, output_tokens=3)  # E 10, P 25 ms
    large = make_trace(150, 20.0, 400, image_tokens=400, output_tokens=3)  # E 40, P 40 ms
    chosen = {}
    for name, trace in (("small", small), ("large", large)):
        evaluator, exhaustive, _ = search_plans(
            trace, cost, slo, 8, methods=[Method.E_P_D], with_heuristic=False, show_progress=False
        )
        plan = plan_from_search(evaluator, exhaustive, None, slo)
        assert plan is not None, name
        chosen[name] = plan
    assert chosen["large"].pools[Role.E] > chosen["small"].pools[Role.E], chosen


def test_pruned_search_finds_what_brute_force_finds() -> None:
    cost = toy_cost_model(encode_per_image_s=0.015)
    slo = SLO(ttft_s=0.3, tpot_s=0.05)
    trace = make_trace(num=100, rate_rps=20, output_tokens=4, text_only_every=2)
    _, exhaustive, heuristic = search_plans(trace, cost, slo, 4, show_progress=False)
    brute = Evaluator(trace, cost, slo)
    goodputs = {}
    for candidate in enumerate_candidates(4):
        bound = brute.bound(candidate)
        if bound > 0:
            goodputs[candidate] = brute.searched(candidate, bound, bound / 2).goodput_rps or 0.0
    best = exhaustive.best
    assert best is not None and best.goodput_rps is not None
    assert best.goodput_rps >= max(goodputs.values()) / 1.05 - 1e-9
    assert heuristic is not None and heuristic.best is not None
    assert (heuristic.best.goodput_rps or 0) <= best.goodput_rps * 1.05
    assert exhaustive.num_pruned + len(exhaustive.ranked()) == exhaustive.num_candidates


def test_the_chosen_plan_is_a_valid_plan_with_budgets_and_provenance() -> None:
    trace = make_trace(num=80, rate_rps=20, output_tokens=3)
    slo = SLO(ttft_s=0.5, tpot_s=0.05)
    evaluator, exhaustive, heuristic = search_plans(
        trace, toy_cost_model(), slo, 3, show_progress=False
    )
    plan = plan_from_search(evaluator, exhaustive, heuristic, slo, window="last 80 requests")
    assert plan is not None
    assert Plan.model_validate_json(plan.model_dump_json()) == plan
    assert set(plan.budgets) == set(plan.method.roles)
    assert plan.predicted is not None and plan.predicted.goodput_rps > 0
    assert plan.predicted.ttft_p90_s <= slo.ttft_s
    assert plan.trace is not None and plan.trace.requests == 80
    assert plan.trace.digest.startswith("sha256:")
    assert plan.num_instances == 3
    table = format_table(table_rows(exhaustive))
    assert plan.describe().split()[1] in table


def test_a_slo_out_of_reach_yields_no_plan() -> None:
    trace = make_trace(num=20, output_tokens=3)
    slo = SLO(ttft_s=0.001, tpot_s=0.05)  # below any prefill time
    evaluator, exhaustive, _ = search_plans(
        trace, toy_cost_model(), slo, 3, with_heuristic=False, show_progress=False
    )
    assert plan_from_search(evaluator, exhaustive, None, slo) is None
    assert exhaustive.num_simulations == 0  # every bound is 0: nothing to simulate


@pytest.mark.parametrize("method", list(Method))
def test_bound_is_never_below_the_simulated_goodput(method: Method) -> None:
    cost = toy_cost_model()
    slo = SLO(ttft_s=0.5, tpot_s=0.05)
    trace = make_trace(num=100, rate_rps=20, output_tokens=4, text_only_every=3)
    evaluator = Evaluator(trace, cost, slo)
    candidate = Candidate(method, tuple([2] * len(method.roles)))
    bound = evaluator.bound(candidate)
    found = evaluator.searched(candidate, bound, bound / 4)
    assert (found.goodput_rps or 0.0) <= bound + 1e-9


def test_parallel_workers_find_the_same_best_plan() -> None:
    cost = toy_cost_model(encode_per_image_s=0.015)
    slo = SLO(ttft_s=0.3, tpot_s=0.05)
    trace = make_trace(num=100, rate_rps=20, output_tokens=4, text_only_every=2)
    _, serial, _ = search_plans(trace, cost, slo, 5, with_heuristic=False, show_progress=False)
    _, parallel, _ = search_plans(
        trace, cost, slo, 5, with_heuristic=False, show_progress=False, num_workers=2
    )
    assert serial.best is not None and parallel.best is not None
    assert parallel.best.goodput_rps == pytest.approx(serial.best.goodput_rps, rel=0.05)
    assert parallel.num_candidates == serial.num_candidates
    assert len(parallel.evaluations) == parallel.num_candidates
