"""The rate forecast an elastic plan is sized for (``planning/forecast.py``), and the horizon it
projects over (``planning/horizon.py``)."""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from epd_operator.planning.forecast import (
    forecast_rates,
    forecast_window,
    num_bins,
    sub_window_rates,
    theil_sen,
)
from epd_operator.planning.horizon import DEFAULT_SWITCH_S, rollout_horizon, switch_seconds

BIN_S = 150.0


def poisson_arrivals(
    rate_of: Callable[[float], float], span_s: float, seed: int = 0
) -> list[float]:
    """Arrivals of a Poisson process whose rate at ``t`` is ``rate_of(t)`` (thinning)."""
    rng = random.Random(seed)
    peak = max(rate_of(t * span_s / 100) for t in range(101))
    out: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= span_s:
            return out
        if rng.random() < rate_of(t) / peak:
            out.append(t)


def test_theil_sen_ignores_one_outlier() -> None:
    xs = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    slope, intercept = theil_sen(xs, [1.0, 3.0, 5.0, 100.0, 9.0, 11.0])
    assert (slope, intercept) == (2.0, 1.0)


def test_sub_windows_count_every_arrival_once() -> None:
    rates = sub_window_rates([0.0, 1.0, 149.9, 150.0, 899.0, 900.0], 900.0, 6)
    assert [r * BIN_S for r in rates] == [3, 1, 0, 0, 0, 2]


@pytest.mark.parametrize("seed", range(3))
def test_a_stationary_load_forecasts_about_its_rate(seed: int) -> None:
    """30 rps for 900 s (27,000 requests): the forecast is within 3 % of the window's rate."""
    got = forecast_window(poisson_arrivals(lambda t: 30.0, 900.0, seed), 900.0, 120.0, 300.0)
    assert got.seen_rps == pytest.approx(30.0, rel=0.02)
    assert got.forecast_rps == pytest.approx(got.seen_rps, rel=0.03)


def test_a_ramp_forecasts_above_the_newest_sub_window_by_trend_times_horizon() -> None:
    rates = [10.0, 12.0, 14.0, 16.0, 18.0, 20.0]  # +2 rps every 150 s
    got = forecast_rates(rates, BIN_S, seen_rps=15.0, horizon_s=120.0, hold_s=300.0)
    slope = 2.0 / BIN_S
    assert got.trend_rps_per_s == pytest.approx(slope)
    # the newest rate is the rate at its sub-window's centre, half a bin before the end
    assert got.forecast_rps == pytest.approx(20.0 + slope * (BIN_S / 2 + 120.0))
    assert got.forecast_rps - got.newest_rps >= slope * 120.0
    assert got.rule == "trend" and got.forecast_rps > got.seen_rps


def test_a_ramp_from_arrivals_sizes_past_the_windows_mean() -> None:
    """Poisson arrivals from 10 to 40 rps over 900 s: the window's mean (25) trails the rate
    now (40); the forecast leads it."""
    arrivals = poisson_arrivals(lambda t: 10.0 + 30.0 * t / 900.0, 900.0)
    got = forecast_window(arrivals, 900.0, 120.0, 300.0)
    assert got.seen_rps == pytest.approx(25.0, rel=0.03)
    assert got.forecast_rps == pytest.approx(40.0 + 30.0 / 900.0 * 120.0, rel=0.05)


def test_rising_never_forecasts_below_the_newest_sub_window() -> None:
    got = forecast_rates([10.0, 10.0, 10.0, 10.0, 10.0, 30.0], BIN_S, 13.3, 120.0, 0.0)
    assert got.projected_rps == pytest.approx(10.0)  # one jump is not a trend
    assert got.forecast_rps == 30.0  # but it is what arrives now


def test_a_spike_then_a_drop_is_bounded_and_forgotten_after_the_stabilisation_window() -> None:
    spike = [10.0, 10.0, 10.0, 80.0, 10.0, 10.0]
    # the spike left the 300 s window (the last two sub-windows): back to the base
    gone = forecast_rates(spike, BIN_S, 21.7, 120.0, hold_s=300.0)
    assert gone.forecast_rps == pytest.approx(10.0)
    # still inside a 450 s window: held at the spike, never above it
    held = forecast_rates(spike, BIN_S, 21.7, 120.0, hold_s=450.0)
    assert held.forecast_rps == 80.0 and held.rule.startswith("held")


def test_a_drop_holds_the_stabilisation_windows_peak() -> None:
    """Falling: the trend would size for less, the forecast keeps the last 300 s's peak, so the
    pools shrink only once the drop has lasted the whole window."""
    falling = [40.0, 36.0, 32.0, 28.0, 24.0, 20.0]
    got = forecast_rates(falling, BIN_S, 30.0, 120.0, hold_s=300.0)
    assert got.projected_rps < 20.0
    assert got.forecast_rps == 24.0  # the older of the two sub-windows in the hold


def test_too_short_a_window_forecasts_its_rate() -> None:
    assert forecast_window([], 0.0, 120.0, 300.0).forecast_rps == 0.0
    assert forecast_rates([7.0], BIN_S, 7.0, 120.0, 300.0).forecast_rps == 7.0


def test_sparse_windows_get_fewer_sub_windows() -> None:
    assert (num_bins(100), num_bins(200), num_bins(10_000)) == (3, 4, 6)


def test_the_horizon_is_the_last_measured_switch_else_the_default() -> None:
    assert rollout_horizon(None) == (DEFAULT_SWITCH_S, "default")
    assert rollout_horizon(6.5) == (6.5, "last switch")
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    later = t0 + timedelta(seconds=42)
    assert switch_seconds(True, {"a", "b"}, ["a", "b"], t0, later) == 42.0
    assert switch_seconds(True, {"a"}, ["a", "b"], t0, later) is None  # a step, not the plan
    assert switch_seconds(False, {"a", "b"}, ["a", "b"], t0, later) is None


def test_traffic_that_starts_inside_the_window_is_not_projected_as_a_steep_ramp() -> None:
    """The defect: sub-windows of 0, 0, then about 1 rps (the window reaching back before the
    traffic began) made a steep trend line: the real-engine test forecast 58 rps two minutes
    ahead for a level 2.5 rps and sized the most instances allowed (``make bench-elastic``
    sized 13 GPUs for 3.3 rps where 0.8 arrived). The projection now at most doubles the
    newest rate."""
    step = [0.0, 0.0, 0.9, 1.0, 1.1, 1.0]
    near = forecast_rates(step, 10.0, seen_rps=0.67, horizon_s=1.0, hold_s=60.0)
    assert not near.capped and near.forecast_rps == pytest.approx(1.27)
    far = forecast_rates(step, 10.0, seen_rps=0.67, horizon_s=120.0, hold_s=60.0)
    assert far.trend_rps_per_s == pytest.approx(0.02)  # the line would reach 3.7 rps
    assert far.forecast_rps == pytest.approx(2.0) and far.capped
    assert far.rule.startswith("trend, capped at 2x")


def test_a_real_ramp_within_the_cap_is_projected_in_full() -> None:
    rates = [10.0, 12.0, 14.0, 16.0, 18.0, 20.0]
    got = forecast_rates(rates, BIN_S, seen_rps=15.0, horizon_s=600.0, hold_s=300.0)
    assert not got.capped and got.forecast_rps == pytest.approx(20.0 + 2.0 / BIN_S * 675.0)
