"""Reading the front's CPU contention off a measured run (``profiler.front_contention``)."""

from __future__ import annotations

import pytest

from epd_engine.profiler.calibrate import calibrate
from epd_engine.profiler.front_contention import front_contention
from epd_engine.slo.outcomes import RequestResult

from .factories import toy_cost_model


def _decoding(start: float, first: float, done: float) -> RequestResult:
    """A request that is decoding from ``first`` to ``done`` (no front measured)."""
    return RequestResult(
        request_id=f"decoding-{start}", arrival_s=start, ttft_s=first - start, e2e_s=done - start
    )


def _probe(start: float, front: float, index: int) -> RequestResult:
    return RequestResult(
        request_id=f"probe-{index}",
        arrival_s=start,
        prompt_tokens=20,
        output_tokens=2,
        ttft_s=front + 0.004,
        itl_s=(0.001,),
        e2e_s=front + 0.005,
        num_output_tokens=2,
        stage_s={"front": front, "prefill_queue": 0.0, "prefill": 0.004, "decode": 0.001},
    )


def _run(slope: float, overlaps: list[float], base_s: float = 0.012) -> list[RequestResult]:
    """Pairs 1 s apart: a request decoding until ``t + 0.05``, and a probe whose front starts
    ``o`` before that decode ends (so ``o`` of it overlaps the decode) and lasts
    ``base_s + slope * o``."""
    results = []
    for i, overlap in enumerate(overlaps):
        t = float(i)
        results.append(_decoding(t, t + 0.001, t + 0.05))
        results.append(_probe(t + 0.05 - overlap, base_s + slope * overlap, i))
    return results


def test_the_fit_recovers_how_much_decoding_stretches_a_front() -> None:
    overlaps = [0.0, 0.002, 0.004, 0.006, 0.008, 0.010, 0.0, 0.0]
    assert front_contention(_run(0.3, overlaps)) == pytest.approx(0.3, abs=1e-6)
    assert front_contention(_run(0.0, overlaps)) == pytest.approx(0.0, abs=1e-6)


def test_too_few_overlapped_fronts_fit_nothing() -> None:
    """Two fronts that overlapped a decode: a slope through them would be noise."""
    assert front_contention(_run(0.3, [0.0, 0.0, 0.004, 0.008])) is None
    assert front_contention([]) is None


def test_runs_one_after_the_other_are_fitted_apart() -> None:
    """A sweep's rates, concatenated: each run's clock starts at 0, and the decodes of one
    run must not count as overlapping the fronts of another."""
    overlaps = [0.0, 0.002, 0.004, 0.006, 0.008, 0.010]
    lone_probes = [_probe(float(i) + 0.045, 0.012, i) for i in range(len(overlaps))]
    assert front_contention(_run(0.3, overlaps) + lone_probes) == pytest.approx(0.3, abs=1e-6)


def test_the_slope_is_clamped_to_a_share_of_the_cpu() -> None:
    overlaps = [0.0, 0.002, 0.004, 0.006]
    assert front_contention(_run(1.5, overlaps, base_s=0.02)) == 1.0


def test_calibration_stores_it_for_the_simulator() -> None:
    results = _run(0.3, [0.0, 0.002, 0.004, 0.006, 0.008, 0.010])
    calibrated = calibrate(toy_cost_model(), results, source="unit")
    # the decoding requests have no stages: they only compete (calibrate probes the rest)
    assert calibrated.overheads.front_contention == pytest.approx(0.3, abs=1e-6)
    assert calibrated.meta["calibration"]["front_contention"] == pytest.approx(0.3, abs=1e-6)
