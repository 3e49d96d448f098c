"""Goodput: the highest request rate at which >= 90% of requests meet the SLO (HydraInfer).

Both searches take ``run(rate_rps) -> per-request samples``: the load driver passes a function
that replays the trace at that rate against a server; the simulator passes one that simulates
it. The reported goodput is always a rate that was *measured* passing, never interpolated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from epd_engine.config import SLO
from epd_engine.slo.attainment import LatencySample, attainment
from epd_engine.slo.outcomes import BenchSummary, RequestResult, summarize

RunAtRate = Callable[[float], Sequence[LatencySample]]
OnPoint = Callable[["RatePoint", Sequence[LatencySample]], None]


@dataclass(frozen=True)
class RatePoint:
    """One measured rate. ``summary`` is filled when the samples are ``RequestResult``s."""

    rate_rps: float
    attainment: float
    passed: bool
    summary: BenchSummary | None = None


@dataclass(frozen=True)
class GoodputResult:
    goodput_rps: float  # 0.0 when no measured rate passed
    lowest_failing_rps: float | None  # the bracket's upper end; None if max_rps still passed
    points: list[RatePoint] = field(default_factory=list)  # sorted by rate


def _measure(run: RunAtRate, rate_rps: float, slo: SLO, on_point: OnPoint | None) -> RatePoint:
    samples = run(rate_rps)
    share = attainment(samples, slo)
    summary = None
    if samples and all(isinstance(s, RequestResult) for s in samples):
        summary = summarize([s for s in samples if isinstance(s, RequestResult)], slo)
    point = RatePoint(rate_rps, share, share >= slo.attainment - 1e-12, summary)
    if on_point is not None:
        on_point(point, samples)
    return point


def goodput_from_points(points: Sequence[RatePoint]) -> tuple[float, float | None]:
    """(goodput, lowest failing rate) of a sweep: the highest passing rate below the lowest
    failing one, so a noisy pass above a failure is not trusted."""
    failing = [p.rate_rps for p in points if not p.passed]
    lowest_fail = min(failing) if failing else None
    passing = [
        p.rate_rps for p in points if p.passed and (lowest_fail is None or p.rate_rps < lowest_fail)
    ]
    return (max(passing) if passing else 0.0), lowest_fail


def sweep(
    run: RunAtRate, rates_rps: Sequence[float], slo: SLO, on_point: OnPoint | None = None
) -> GoodputResult:
    """Measure every rate (ascending) and read goodput off the curve."""
    points = [_measure(run, rate, slo, on_point) for rate in sorted(rates_rps)]
    goodput, lowest_fail = goodput_from_points(points)
    return GoodputResult(goodput, lowest_fail, points)


def find_goodput(
    run: RunAtRate,
    slo: SLO,
    *,
    start_rps: float = 1.0,
    min_rps: float = 0.05,
    max_rps: float = 1024.0,
    rel_tolerance: float = 0.05,
    max_runs: int = 16,
    on_point: OnPoint | None = None,
) -> GoodputResult:
    """Bracket then bisect: double (or halve) from ``start_rps`` until pass/fail flips, then
    bisect until the bracket is within ``rel_tolerance`` of its upper end or ``max_runs`` runs.

    Assumes attainment falls as rate grows; with noise it still returns a measured pass.
    """
    if not 0 < min_rps <= start_rps <= max_rps:
        raise ValueError(
            f"need 0 < min_rps <= start_rps <= max_rps, got {min_rps}, {start_rps}, {max_rps}"
        )
    points: list[RatePoint] = []

    def probe(rate: float) -> bool:
        point = _measure(run, rate, slo, on_point)
        points.append(point)
        return point.passed

    low: float | None = None  # highest measured pass
    high: float | None = None  # lowest measured fail
    if probe(start_rps):
        low = start_rps
        while high is None and low < max_rps and len(points) < max_runs:
            rate = min(low * 2, max_rps)
            if probe(rate):
                low = rate
            else:
                high = rate
    else:
        high = start_rps
        while low is None and high / 2 >= min_rps and len(points) < max_runs:
            rate = high / 2
            if probe(rate):
                low = rate
            else:
                high = rate
    while (
        low is not None
        and high is not None
        and high - low > rel_tolerance * high
        and len(points) < max_runs
    ):
        mid = (low + high) / 2
        if probe(mid):
            low = mid
        else:
            high = mid
    return GoodputResult(low or 0.0, high, sorted(points, key=lambda p: p.rate_rps))
