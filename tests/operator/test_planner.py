"""Auto mode's planner: the real plan search on traces from the real workload generators,
with the built-in reference cost model (LLaVA-1.5-7B, H800-class)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from epd_engine.config import SLO, Role
from epd_engine.contracts.plan import Plan
from epd_engine.contracts.trace import ImageRef, TraceRecord
from epd_engine.profiler.links import LinkCoeffs
from epd_engine.profiler.reference import reference_cost_model
from epd_engine.workload.arrivals import ArrivalSpec
from epd_engine.workload.generators import random_mm, synthesize
from epd_operator.api.spec import EPDDeploymentSpec, PlanStatus
from epd_operator.planning.choice import WorkloadStats, choose_plan, heuristic_plan
from epd_operator.planning.planner import (
    REFERENCE_LABEL,
    PlanningError,
    auto_planner,
    bounded_profiler_plan,
    cost_model_from_json,
    profiler_plan,
    profiler_proposal,
    subsample,
    workload_stats,
)
from tests.operator.conftest import make_spec_dict, plan_and_ran

# Four small (336x336, 576-token) images per request, short text and answers.
IMAGE_HEAVY = random_mm(input_len=50, output_len=32, base_items_per_request=4,
                        image_sizes=((336, 336),))  # fmt: skip


def auto_spec(**overrides: Any) -> EPDDeploymentSpec:
    fields: dict[str, Any] = {"disaggregation": {"mode": "Auto"}, **overrides}
    return EPDDeploymentSpec.model_validate(make_spec_dict(**fields))


def trace(shape: Any, num: int = 300, seed: int = 0, **kw: Any) -> list[TraceRecord]:
    return synthesize(shape, num, ArrivalSpec("poisson", 5.0), seed=seed, **kw)


def text_light(num: int = 300) -> list[TraceRecord]:
    """EPD-Serve's VisualWebInstruct mix, 90% text-only."""
    return trace("visualwebinstruct", num, text_only_fraction=0.9)


def encode_off_decode_gpus(plan: Plan) -> int:
    """Instances that encode on GPUs that do not decode (pools E and EP)."""
    return sum(n for role, n in plan.pools.items() if role in (Role.E, Role.EP))


@pytest.mark.parametrize("ttft_ms", [250, 4000])
def test_text_only_traffic_never_gets_an_e_pool(ttft_ms: int) -> None:
    spec = auto_spec(slo={"ttftMilliseconds": ttft_ms, "tpotMilliseconds": 80})
    records = trace("visualwebinstruct", text_only_fraction=1.0)
    plan = profiler_plan(spec, records, reference_cost_model())
    assert Role.E not in plan.pools, plan.describe()


def test_image_heavy_tight_ttft_gets_more_encode_capacity_than_text_light() -> None:
    """Under a 250 ms TTFT, four images per request make the planner keep encode (with
    prefill) off the decode GPUs on most of the budget; mostly-text traffic does not."""
    spec = auto_spec(slo={"ttftMilliseconds": 250, "tpotMilliseconds": 80})
    cost = reference_cost_model()
    heavy = profiler_plan(spec, trace(IMAGE_HEAVY), cost)
    light = profiler_plan(spec, text_light(), cost)
    assert encode_off_decode_gpus(heavy) > encode_off_decode_gpus(light), (
        heavy.describe(),
        light.describe(),
    )
    assert encode_off_decode_gpus(heavy) >= 4  # at least half of the 8 GPUs


def test_profiler_plan_fits_the_budget_and_carries_its_prediction() -> None:
    spec = auto_spec(gpuBudget=4)  # pays for 4 one-GPU instances
    plan = profiler_plan(spec, trace("textvqa"), reference_cost_model(), REFERENCE_LABEL)
    assert plan.num_instances == 4
    assert plan.predicted is not None and plan.predicted.goodput_rps > 0
    slo = spec.slo.to_slo()
    assert 0 < plan.predicted.ttft_p90_s <= slo.ttft_s
    assert 0 < plan.predicted.tpot_p90_s <= slo.tpot_s
    assert plan.budgets == {}  # engines measure their own batch budgets
    assert plan.trace is not None and plan.trace.requests == 300
    assert plan.reason.startswith("profiler: best of 13 plans on 300 requests at TTFT<=4s")
    assert REFERENCE_LABEL in plan.reason
    status = PlanStatus.from_plan(plan, 1)
    assert float(status.predicted_goodput_rps) == pytest.approx(plan.predicted.goodput_rps, 0.01)
    assert status.predicted_ttft_p90_milliseconds == round(plan.predicted.ttft_p90_s * 1000)
    back = status.to_plan()
    assert back.predicted is not None and back.describe() == plan.describe()


def test_large_windows_are_sampled_evenly_and_deterministically() -> None:
    records = text_light(500)
    sample = subsample(records, 200)
    assert len(sample) == 200 and sample == subsample(records, 200)
    assert (
        sample[0].arrival_s == 0 and sample[-1].request_id == records[497].request_id
    )  # index i * 500 // 200
    spec = auto_spec(gpuBudget=3)
    plan = profiler_plan(spec, records, reference_cost_model(), max_requests=200)
    assert "on 200 of 500 requests (evenly sampled)" in plan.reason
    assert plan.trace is not None and plan.trace.requests == 200


def test_an_slo_no_plan_can_meet_is_a_planning_error() -> None:
    spec = auto_spec(gpuBudget=2, slo={"ttftMilliseconds": 1, "tpotMilliseconds": 1})
    with pytest.raises(PlanningError, match=r"meets TTFT<=0\.001s"):
        profiler_plan(spec, text_light(50), reference_cost_model())


def test_pods_plan_over_the_link_their_transfer_backend_uses() -> None:
    """Pods cannot map each other's memory, so ``auto`` plans with the measured tcp link;
    local processes can, so local mode's ``auto`` plans with shm."""
    fast, slow = LinkCoeffs(1e-4, 50e9), LinkCoeffs(0.5, 1e6)
    cost = dataclasses.replace(reference_cost_model(), links={"shm": fast, "tcp": slow})
    records = trace("textvqa", 100)
    auto = profiler_plan(auto_spec(gpuBudget=2), records, cost, "measured")
    assert auto.reason.endswith("cost model: measured, tcp link")
    shm = auto_spec(gpuBudget=2, engine={"transferBackend": "shm"})
    assert profiler_plan(shm, records, cost, "measured").reason.endswith(", shm link")
    # local mode (`epdctl up`): every instance on one host, so auto maps a peer's memory
    local = profiler_proposal(auto_spec(gpuBudget=2), records, cost, "measured", same_host=True)
    assert local.plan.reason.endswith("cost model: measured, shm link")
    plain = profiler_plan(auto_spec(gpuBudget=2), records, reference_cost_model(), "ref")
    assert plain.reason.endswith("cost model: ref")  # no measured links: the stored one


def test_bounded_search_gives_the_same_plan_or_stops_at_its_time_limit() -> None:
    spec = auto_spec(gpuBudget=3)
    records = trace("textvqa", 200)
    cost = reference_cost_model()
    inline = profiler_plan(spec, records, cost, "ref")
    bounded = bounded_profiler_plan(spec, records, cost, "ref", timeout_s=120).plan
    assert bounded == inline
    with pytest.raises(PlanningError, match=r"longer than 0\.01 s"):
        bounded_profiler_plan(spec, records, cost, "ref", timeout_s=0.01)


def test_cost_model_json_round_trips_and_bad_json_is_named() -> None:
    text = json.dumps(reference_cost_model().to_dict())
    assert cost_model_from_json(text, "cm/key") == reference_cost_model()
    with pytest.raises(ValueError, match="cm/key: not valid JSON"):
        cost_model_from_json("{", "cm/key")
    with pytest.raises(ValueError, match="cm/key: not a cost model"):
        cost_model_from_json('{"kind": "other"}', "cm/key")


def test_workload_stats_match_hand_computed_means() -> None:
    image = ImageRef(tokens=576, hash="h", width=336, height=336)
    records = [
        TraceRecord(arrival_s=0.0, prompt_tokens=10, output_tokens=4, ttft_s=0.1, tpot_s=0.05),
        TraceRecord(
            arrival_s=1.0, prompt_tokens=20, images=(image, image), output_tokens=8, ttft_s=2.0
        ),
        TraceRecord(arrival_s=2.0, prompt_tokens=30, images=(image,), output_tokens=12),
        TraceRecord(
            arrival_s=3.0, prompt_tokens=40, output_tokens=16, ttft_s=0.2, tpot_s=(0.01, 0.2)
        ),
    ]
    stats = workload_stats(records, 8.0, SLO(ttft_s=1.0, tpot_s=0.1))
    assert stats.num_requests == 4
    assert stats.request_rate_rps == 0.5
    assert stats.mean_prompt_tokens == 25.0  # (10 + 20 + 30 + 40) / 4
    assert stats.mean_images == 0.75  # (0 + 2 + 1 + 0) / 4
    assert stats.mean_output_tokens == 10.0  # (4 + 8 + 12 + 16) / 4
    # measured: 1st meets both, 2nd misses TTFT, 4th's p90 gap 0.2 s misses TPOT
    assert stats.slo_attainment == pytest.approx(1 / 3)
    assert workload_stats(records, 8.0).slo_attainment is None
    empty = workload_stats([], 900.0)
    assert (empty.num_requests, empty.request_rate_rps, empty.mean_images) == (0, 0.0, None)


# --- choose_plan with the operator's planner -------------------------------------------------


def test_choose_plan_runs_the_profiler_when_the_window_has_enough_requests() -> None:
    spec = auto_spec(gpuBudget=4, profiler={"minRequests": 100})
    records = trace("textvqa", 200)
    stats = workload_stats(records, 900.0)
    plan, ran = plan_and_ran(
        choose_plan(spec, None, stats, None, 0, auto_planner(records, timeout_s=120))
    )
    assert ran and plan.reason.startswith("profiler: best of")
    assert plan.predicted is not None and plan.predicted.goodput_rps > 0
    assert plan.num_instances == 4

    # a later pass: interval passed, the workload shifted (now image-heavy) -> profiler again
    current = PlanStatus.from_plan(plan, 1)
    heavy = trace(IMAGE_HEAVY, 200)
    replanned, ran = plan_and_ran(
        choose_plan(
            spec,
            current,
            workload_stats(heavy, 900.0),
            stats,
            10_000,
            auto_planner(heavy, timeout_s=120),
        )
    )
    assert ran and replanned.reason.startswith("profiler:")
    assert replanned.trace is not None and plan.trace is not None
    assert replanned.trace.digest != plan.trace.digest


def test_choose_plan_falls_back_to_the_heuristic_and_says_why() -> None:
    spec = auto_spec(gpuBudget=4, profiler={"minRequests": 100})
    few = trace("textvqa", 40)
    plan, ran = plan_and_ran(
        choose_plan(spec, None, workload_stats(few, 900.0), None, 0, auto_planner(few))
    )
    assert ran and plan.predicted is None
    assert plan.reason == (
        "heuristic split of the GPU budget on 40 requests "
        "(40 requests in the trace window, profiler needs 100)"
    )

    unreachable, _ = plan_and_ran(choose_plan(spec, None, None, None, 0, auto_planner(None)))
    assert unreachable.reason == (
        "heuristic split of the GPU budget (no trace yet: router trace unavailable)"
    )
    assert unreachable == heuristic_plan(spec, None, "router trace unavailable")

    def broken_cost_model() -> Any:
        raise ValueError("ConfigMap serving/costs not found")

    records = trace("textvqa", 150)
    stats = workload_stats(records, 900.0)
    fallback, _ = plan_and_ran(
        choose_plan(spec, None, stats, None, 0, auto_planner(records, broken_cost_model))
    )
    assert fallback.reason.endswith("(profiler gave no plan: ConfigMap serving/costs not found)")
    assert fallback.pools == heuristic_plan(spec, stats).pools


def test_auto_planner_keeps_the_plan_until_a_replan_is_due() -> None:
    spec = auto_spec(gpuBudget=4, profiler={"minRequests": 100})
    current = PlanStatus.from_plan(heuristic_plan(spec, None), 1)
    records = trace("textvqa", 150)
    stats = WorkloadStats(150, 1.0)
    kept, ran = plan_and_ran(choose_plan(spec, current, stats, None, 10, auto_planner(records)))
    assert not ran and kept == current.to_plan()


def test_a_replan_on_an_unchanged_window_starts_from_the_current_plan() -> None:
    """Defect: every re-plan searched from scratch, though the window slides a little each
    interval and the answer rarely moves. The current plan is now searched first from its
    predicted goodput (a ``Hint``): same plan, fewer simulations."""
    spec = auto_spec(slo={"ttftMilliseconds": 250, "tpotMilliseconds": 80})
    cost = reference_cost_model()
    window = trace(IMAGE_HEAVY, num=400)
    first = profiler_proposal(spec, window, cost)
    again = profiler_proposal(spec, window, cost, current=first.plan)
    assert again.plan.describe() == first.plan.describe()
    assert first.num_simulations is not None and again.num_simulations is not None
    assert again.num_simulations < first.num_simulations, (
        first.num_simulations,
        again.num_simulations,
    )
