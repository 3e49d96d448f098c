from __future__ import annotations

import pytest

from epd_engine.bench.metrics import RequestResult
from epd_engine.config import SLO, Method, Role
from epd_engine.plan import Plan
from epd_engine.profiler.calibrate import calibrate, quantiles
from epd_engine.profiler.simulator import simulate

from .factories import make_trace, toy_cost_model


def _result(i: int, ttft_s: float, gaps: tuple[float, ...]) -> RequestResult:
    return RequestResult(
        request_id=f"r{i}",
        arrival_s=float(i),
        prompt_tokens=20,
        num_images=0,
        output_tokens=len(gaps) + 1,
        ttft_s=ttft_s,
        itl_s=gaps,
        e2e_s=ttft_s + sum(gaps),
        num_output_tokens=len(gaps) + 1,
        stage_s={"prefill_queue": 0.01, "prefill": 0.04, "decode": sum(gaps)},
    )


def test_calibration_recovers_request_and_step_overheads() -> None:
    cost = toy_cost_model(decode_step_s=0.005)
    step = cost.decode_s(1, 22)
    results = [_result(i, 0.15, (step + 0.01,) * 4) for i in range(10)]
    calibrated = calibrate(cost, results, source="unit")
    assert calibrated.overheads.request_s == pytest.approx(0.1)  # 0.15 - 0.01 - 0.04
    assert calibrated.overheads.step_s == pytest.approx(0.01, abs=1e-4)
    assert calibrated.meta["calibration"]["num_requests"] == 10
    assert all(q == pytest.approx(0.01, abs=1e-4) for q in calibrated.overheads.step_s_quantiles)


def test_calibrated_overheads_show_up_in_simulated_latency() -> None:
    cost = toy_cost_model()
    step = cost.decode_s(1, 22)
    calibrated = calibrate(cost, [_result(i, 0.15, (step + 0.01,) * 4) for i in range(10)])
    plan = Plan(method=Method.EPD, pools={Role.EPD: 1})
    trace = make_trace(num=1, images_per_request=0, output_tokens=3)
    slo = SLO(ttft_s=10, tpot_s=1)
    [plain] = simulate(plan, trace, cost, slo).results
    [slowed] = simulate(plan, trace, calibrated, slo).results
    assert slowed.ttft_s is not None and plain.ttft_s is not None
    assert slowed.ttft_s == pytest.approx(plain.ttft_s + 0.1 + 0.01, abs=1e-3)
    assert slowed.itl_s[0] == pytest.approx(plain.itl_s[0] + 0.01, abs=1e-3)


def test_calibration_needs_stage_timings() -> None:
    bare = RequestResult(request_id="x", arrival_s=0.0, ttft_s=0.1, itl_s=(0.01,))
    with pytest.raises(ValueError, match="stage_s"):
        calibrate(toy_cost_model(), [bare])


def test_quantiles_are_evenly_spaced_midpoints() -> None:
    assert quantiles([]) == ()
    assert quantiles([float(i) for i in range(100)], num=4) == (12.0, 37.0, 62.0, 87.0)
