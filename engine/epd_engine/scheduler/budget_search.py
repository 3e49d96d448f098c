"""Start-up search for the batch budgets (HydraInfer): the largest batch under a time limit.

Pure: the engine passes a ``measure`` function that runs a real batch of the given size and
returns its iteration time in seconds. Only a size that was measured as passing is returned.
"""

from __future__ import annotations

from collections.abc import Callable


class BudgetSearchError(RuntimeError):
    """Even the smallest batch misses the limit: the SLO cannot be met on this hardware."""


def search_budget(measure: Callable[[int], float], limit_s: float, max_size: int) -> int:
    """Largest ``n`` in ``[1, max_size]`` with ``measure(n) <= limit_s`` (time grows with n)."""
    if max_size < 1:
        raise ValueError(f"max_size must be >= 1, got {max_size}")
    first_s = measure(1)
    if first_s > limit_s:
        raise BudgetSearchError(
            f"a batch of 1 takes {first_s * 1e3:.1f} ms, over the {limit_s * 1e3:.1f} ms limit"
        )
    passing, failing = 1, max_size + 1  # invariant: passing measured ok, failing not ok
    while failing - passing > 1:
        mid = (passing + failing) // 2
        if measure(mid) <= limit_s:
            passing = mid
        else:
            failing = mid
    return passing
