"""Elastic capacity: the fewest instances whose best plan's simulated goodput covers a target
rate (``spec.capacity``: the forecast rate times the headroom; ``forecast``).

The plan search runs for one instance count at a time; this binary-searches the count in the
allowed range, taking the best goodput as non-decreasing in instances (one more instance in
any pool of a plan never lowers its goodput, so the best over every method and ratio does
not either). A count whose search finds no plan at the SLO counts as not covering.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from epd_engine.profiler.search import SearchResult


@dataclass(frozen=True)
class SizedSearch:
    num_instances: int
    result: SearchResult
    covers: bool  # the best plan's goodput reaches the target
    num_searches: int  # plan searches run to find the count


def goodput_of(result: SearchResult) -> float:
    """The best plan's goodput (0: no plan meets the SLO at any rate)."""
    if result.best is None:
        return 0.0
    return result.best.goodput_rps or 0.0


def fewest_instances(
    search: Callable[[int], SearchResult], low: int, high: int, target_rps: float
) -> SizedSearch:
    """The fewest instances in ``[low, high]`` whose best plan covers ``target_rps``; ``high``
    (not covering) when even that falls short."""
    if not 1 <= low <= high:
        raise ValueError(f"instance range [{low}, {high}] is empty")
    results: dict[int, SearchResult] = {}

    def covers(n: int) -> bool:
        if n not in results:
            results[n] = search(n)
        return goodput_of(results[n]) >= target_rps

    if not covers(high):
        return SizedSearch(high, results[high], False, len(results))
    lo, hi = low, high
    while lo < hi:
        mid = (lo + hi) // 2
        if covers(mid):
            hi = mid
        else:
            lo = mid + 1
    covers(lo)  # searched already unless lo == high
    return SizedSearch(lo, results[lo], True, len(results))
