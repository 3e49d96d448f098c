from __future__ import annotations

import numpy as np
import pytest

from epd_engine.contracts.trace import mean_rate_rps
from epd_engine.workload.arrivals import (
    ArrivalSpec,
    at_rate,
    gamma_arrivals,
    poisson_arrivals,
    scale_time,
    uniform_arrivals,
    with_arrivals,
)
from epd_engine.workload.generators import generate


def _cv(times: np.ndarray) -> float:
    gaps = np.diff(times)
    return float(gaps.std() / gaps.mean())


def test_poisson_rate_and_unit_cv() -> None:
    times = poisson_arrivals(20_000, 5.0, np.random.default_rng(0))
    assert times[0] == 0.0
    assert (len(times) - 1) / times[-1] == pytest.approx(5.0, rel=0.03)
    assert _cv(times) == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("cv", [0.5, 3.0])
def test_gamma_keeps_rate_and_sets_cv(cv: float) -> None:
    times = gamma_arrivals(20_000, 2.0, cv, np.random.default_rng(1))
    assert (len(times) - 1) / times[-1] == pytest.approx(2.0, rel=0.05)
    assert _cv(times) == pytest.approx(cv, rel=0.08)


def test_uniform_and_spec() -> None:
    assert list(uniform_arrivals(3, 2.0)) == [0.0, 0.5, 1.0]
    spec = ArrivalSpec("gamma", 3.0, cv=2.0)
    assert np.array_equal(spec.sample(100, seed=5), spec.sample(100, seed=5))
    with pytest.raises(ValueError):
        ArrivalSpec("poisson", 0.0)
    with pytest.raises(ValueError):
        ArrivalSpec("weibull", 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        gamma_arrivals(3, 1.0, 0.0, np.random.default_rng(0))


def test_rate_scaling_keeps_the_burst_pattern() -> None:
    records = with_arrivals(generate("pope", 5), [10.0, 10.5, 12.0, 12.1, 14.0])
    scaled = at_rate(records, 4.0)
    assert mean_rate_rps(scaled) == pytest.approx(4.0)
    gaps = np.diff([r.arrival_s for r in scaled])
    assert gaps / gaps[0] == pytest.approx(np.array([0.5, 1.5, 0.1, 1.9]) / 0.5)
    assert scaled[0].arrival_s == 0.0
    stretched = [r.arrival_s for r in scale_time(records, 2.0)]
    assert stretched == pytest.approx([0.0, 1.0, 4.0, 4.2, 8.0])


def test_at_rate_spreads_a_trace_without_arrivals() -> None:
    scaled = at_rate(generate("pope", 4), 2.0)
    assert [r.arrival_s for r in scaled] == [0.0, 0.5, 1.0, 1.5]
    with pytest.raises(ValueError):
        with_arrivals(generate("pope", 2), [0.0])
