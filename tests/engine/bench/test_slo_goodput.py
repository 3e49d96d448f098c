from __future__ import annotations

import pytest

from epd_engine.config import SLO
from epd_engine.slo.attainment import attainment, meets_slo, passes
from epd_engine.slo.goodput import RatePoint, find_goodput, goodput_from_points, sweep
from epd_engine.slo.outcomes import RequestResult, summarize

SLO_TIGHT = SLO(ttft_s=1.0, tpot_s=0.1)


def result(
    ttft_s: float | None = 0.5, gaps: tuple[float, ...] = (0.05,) * 9, **kw: object
) -> RequestResult:
    return RequestResult(request_id="r", arrival_s=0.0, ttft_s=ttft_s, itl_s=gaps, **kw)  # type: ignore[arg-type]


def test_meets_slo_on_boundaries() -> None:
    assert meets_slo(result(1.0, (0.1,) * 5), SLO_TIGHT)  # equal to the SLO is met
    assert not meets_slo(result(1.01), SLO_TIGHT)
    assert meets_slo(result(0.5, (0.05,) * 9 + (5.0,)), SLO_TIGHT)  # 90% of gaps in time
    assert not meets_slo(result(0.5, (0.05,) * 8 + (5.0, 5.0)), SLO_TIGHT)
    assert meets_slo(result(0.5, ()), SLO_TIGHT)  # a 1-token answer has no gaps to miss
    assert not meets_slo(result(None), SLO_TIGHT)
    assert not meets_slo(result(0.1, error="APIError: boom"), SLO_TIGHT)


def test_attainment_counts_errors_as_misses() -> None:
    samples = [result() for _ in range(9)] + [result(error="Timeout: x")]
    assert attainment(samples, SLO_TIGHT) == pytest.approx(0.9)
    assert passes(samples, SLO_TIGHT)
    assert not passes([*samples[1:], result(2.0)], SLO_TIGHT)
    assert attainment([], SLO_TIGHT) == 0.0


def test_summarize_statistics() -> None:
    results = [
        result(float(t), (0.01, 0.03), e2e_s=float(t) + 0.04, num_output_tokens=3)
        for t in range(1, 101)
    ]
    results.append(result(None, error="APIConnectionError: refused"))
    summary = summarize(results, SLO(ttft_s=50.0, tpot_s=0.1))
    assert (summary.num_requests, summary.num_ok, summary.num_errors) == (101, 100, 1)
    assert summary.ttft.mean_s == pytest.approx(50.5)
    assert summary.ttft.p50_s == pytest.approx(50.5)
    assert summary.ttft.p90_s == pytest.approx(90.1)
    assert summary.ttft.p99_s == pytest.approx(99.01)
    assert summary.tpot.mean_s == pytest.approx(0.02)
    assert summary.tpot_p90.mean_s == pytest.approx(0.03)
    assert summary.itl.count == 200
    assert summary.attainment == pytest.approx(50 / 101)
    assert summary.errors == {"APIConnectionError": 1}
    assert summary.num_short_outputs == 0
    short = result(0.1, (), output_tokens=5, num_output_tokens=2)
    assert summarize([short]).num_short_outputs == 1


def test_summarize_attainment_is_the_per_request_definition() -> None:
    """``summarize`` sorts each request's gaps once for its p90 statistics and its
    attainment; the share must stay ``attainment``'s (errors, late TTFT and p90 gaps, a
    request without gaps, a TTFT of exactly 0 all in)."""
    import random

    rng = random.Random(3)
    samples = [
        result(
            rng.choice([None, 0.0, 0.5, 1.0, 1.5]),
            tuple(rng.choice([0.05, 0.1, 0.2]) for _ in range(rng.randint(0, 12))),
            error=rng.choice([None, None, None, "Timeout: x"]),
        )
        for _ in range(400)
    ]
    assert summarize(samples, SLO_TIGHT).attainment == attainment(samples, SLO_TIGHT)


def step_server(capacity_rps: float) -> tuple[list[float], object]:
    """run(rate): everyone meets the SLO below capacity, nobody above."""
    calls: list[float] = []

    def run(rate: float) -> list[RequestResult]:
        calls.append(rate)
        return [result(0.5 if rate <= capacity_rps else 3.0) for _ in range(10)]

    return calls, run


@pytest.mark.parametrize("start", [1.0, 50.0])
def test_bisection_finds_a_measured_passing_rate_near_capacity(start: float) -> None:
    calls, run = step_server(7.3)
    found = find_goodput(run, SLO_TIGHT, start_rps=start, rel_tolerance=0.02)  # type: ignore[arg-type]
    assert 7.3 * 0.97 <= found.goodput_rps <= 7.3
    assert found.goodput_rps in calls  # never interpolated
    assert found.lowest_failing_rps is not None and found.lowest_failing_rps > 7.3
    assert [p.rate_rps for p in found.points] == sorted(calls)


def test_bisection_edges() -> None:
    _, never = step_server(0.0)
    assert find_goodput(never, SLO_TIGHT, start_rps=1.0, min_rps=0.1).goodput_rps == 0.0  # type: ignore[arg-type]
    _, always = step_server(1e9)
    found = find_goodput(always, SLO_TIGHT, start_rps=1.0, max_rps=16.0)  # type: ignore[arg-type]
    assert found.goodput_rps == 16.0 and found.lowest_failing_rps is None
    calls, run = step_server(5.0)
    find_goodput(run, SLO_TIGHT, max_runs=4)  # type: ignore[arg-type]
    assert len(calls) == 4
    with pytest.raises(ValueError):
        find_goodput(run, SLO_TIGHT, start_rps=0.0)  # type: ignore[arg-type]


def test_sweep_trusts_no_pass_above_a_failure() -> None:
    points = [RatePoint(1, 1.0, True), RatePoint(2, 0.95, True), RatePoint(4, 0.5, False),
              RatePoint(8, 0.92, True)]  # fmt: skip
    assert goodput_from_points(points) == (2, 4)
    _, run = step_server(3.0)
    swept = sweep(run, [4.0, 1.0, 2.0], SLO_TIGHT)  # type: ignore[arg-type]
    assert [p.rate_rps for p in swept.points] == [1.0, 2.0, 4.0]
    assert swept.goodput_rps == 2.0
    assert swept.points[0].summary is not None and swept.points[0].summary.num_requests == 10
