"""The rate an elastic plan is sized for: the rate expected once the plan serves, forecast
from the trace window's recent sub-windows.

A plan decided now serves only after its rollout (new pools start, the routing switches), so
the loop sizes it for the rate at ``now + horizon``, not for the window's mean (which trails a
ramp by half the window). The window is cut into equal sub-windows; the trend is the
Theil-Sen line through their rates (the median of all pairwise slopes): robust to a burst in
one sub-window (up to about 29 % of them), no smoothing constants to tune (Holt's method needs
two), and stateless -- the same window gives the same forecast, whichever pass (or operator
replica) reads it. The line is projected to the window's end plus the horizon.

The projection is at most ``GROWTH_CAP`` times the newest sub-window's rate. A line through a
step is steep: traffic that starts (or jumps) inside the window -- sub-windows of 0, 0, then
1 rps -- projected 3.3 rps one second ahead in ``make bench-elastic`` (13 GPUs where 4 served)
and 58 rps two minutes ahead in the real-engine test, where what arrived was a level rate.
Doubling within one rollout is as fast as the HPA's default scale-up policy lets a pool grow
(100 % per period); a faster surge is the fast path's (``fast_path.py``), which reacts to the
queues within a pass.

The forecast is never below the highest sub-window rate within the last ``hold_s`` seconds
(the scale-down stabilisation window; at least the newest sub-window). Rising, that is the last
observed rate: a trend that under-fits the newest sub-window does not plan below what is
already arriving. Falling, it is the window's peak, as Kubernetes' HPA keeps the highest
recommendation of its stabilisation window: a drop shrinks the pools only once it has lasted
the whole window, and a burst counts until it has left it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from statistics import median

GROWTH_CAP = 2.0  # the projection at most doubles the newest sub-window's rate
MAX_BINS = 6
MIN_BINS = 3
REQUESTS_PER_BIN = 50  # fewer sub-windows on a sparse window: a bin of 50 has ~14 % noise


@dataclass(frozen=True)
class Forecast:
    seen_rps: float  # the window's mean rate (what the loop sized for before)
    newest_rps: float  # the newest sub-window's rate
    trend_rps_per_s: float  # Theil-Sen slope over the sub-windows
    horizon_s: float  # how far past the window's end it projects (the rollout time)
    projected_rps: float  # the trend line at the window's end + the horizon, capped
    held_rps: float  # the highest sub-window rate within the hold (stabilisation window)
    forecast_rps: float  # max(projected, held, profile)
    capped: bool = False  # the trend line went past GROWTH_CAP x the newest rate
    profile_ratio: float | None = None  # a day ago, the rate a horizon later over the rate then
    profile_rps: float | None = None  # the window's rate times that ratio (capped)

    @property
    def rule(self) -> str:
        """Which of the three set the forecast, in words for the status."""
        if self.profile_rps is not None and self.profile_rps > max(
            self.projected_rps, self.held_rps
        ):
            return (
                f"daily profile: a day ago the rate {self.horizon_s:.0f} s later was "
                f"{self.profile_ratio:.2f}x, applied to this window's rate"
            )
        if self.projected_rps >= self.held_rps:
            if self.capped:
                return f"trend, capped at {GROWTH_CAP:g}x the newest sub-window's rate"
            return "trend"
        return "held: highest sub-window rate of the stabilisation window"


def num_bins(num_requests: int) -> int:
    return min(MAX_BINS, max(MIN_BINS, num_requests // REQUESTS_PER_BIN))


def sub_window_rates(arrivals_s: Sequence[float], span_s: float, bins: int) -> list[float]:
    """Rates of ``bins`` equal sub-windows of ``[0, span_s]``, oldest first."""
    width = span_s / bins
    counts = [0] * bins
    for t in arrivals_s:
        counts[min(bins - 1, max(0, int(t / width)))] += 1
    return [c / width for c in counts]


def theil_sen(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(slope, intercept): the median pairwise slope, the median of ``y - slope * x``."""
    slopes = [
        (ys[j] - ys[i]) / (xs[j] - xs[i])
        for i in range(len(xs))
        for j in range(i + 1, len(xs))
        if xs[j] != xs[i]
    ]
    slope = median(slopes) if slopes else 0.0
    return slope, median(y - slope * x for x, y in zip(xs, ys, strict=True))


def forecast_rates(
    rates: Sequence[float], bin_s: float, seen_rps: float, horizon_s: float, hold_s: float
) -> Forecast:
    """The forecast from sub-window ``rates`` (oldest first, each ``bin_s`` long)."""
    if len(rates) < 2 or bin_s <= 0:
        return Forecast(seen_rps, seen_rps, 0.0, horizon_s, seen_rps, seen_rps, seen_rps)
    centres = [(k + 0.5) * bin_s for k in range(len(rates))]
    slope, intercept = theil_sen(centres, rates)
    line = max(0.0, intercept + slope * (len(rates) * bin_s + horizon_s))
    projected = min(line, GROWTH_CAP * rates[-1])
    held_bins = min(len(rates), max(1, math.ceil(hold_s / bin_s)))
    held = max(rates[-held_bins:])
    forecast = max(projected, held)
    return Forecast(
        seen_rps, rates[-1], slope, horizon_s, projected, held, forecast, capped=line > projected
    )


def forecast_window(
    arrivals_s: Sequence[float], span_s: float, horizon_s: float, hold_s: float
) -> Forecast:
    """The forecast of a trace window: arrivals in seconds since its start, ``span_s`` long."""
    seen = len(arrivals_s) / span_s if span_s > 0 else 0.0
    if span_s <= 0:
        return forecast_rates([], 0.0, seen, horizon_s, hold_s)
    bins = num_bins(len(arrivals_s))
    rates = sub_window_rates(arrivals_s, span_s, bins)
    return forecast_rates(rates, span_s / bins, seen, horizon_s, hold_s)


def with_profile(forecast: Forecast, ratio: float | None) -> Forecast:
    """``forecast`` with the daily profile's (``daily_profile``) as a floor: this window's
    rate times ``ratio``, at most ``GROWTH_CAP`` times it. Unchanged without a ratio."""
    if ratio is None or ratio < 0:
        return forecast
    profile = forecast.seen_rps * min(ratio, GROWTH_CAP)
    return replace(
        forecast,
        profile_ratio=ratio,
        profile_rps=profile,
        forecast_rps=max(forecast.forecast_rps, profile),
    )
