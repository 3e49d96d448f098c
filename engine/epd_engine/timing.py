"""Timing a piece of work on a noisy host."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_of(run: Callable[[], object], repeats: int = 3) -> float:
    """Fastest of ``repeats`` runs after one warm-up: the work's time without scheduling noise."""
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best
