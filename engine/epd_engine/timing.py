"""Timing a piece of work on a noisy host, or on an accelerator that runs asynchronously.

torch is imported only for CUDA timing: the profiler imports this without torch.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@functools.cache
def clock_domain() -> str:
    """Processes that report the same value share ``time.monotonic()``: Linux's boot id
    (CLOCK_MONOTONIC counts from boot, one per host); "" where unknown (never compare)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def best_of(
    run: Callable[[], object], repeats: int = 3, device: torch.device | str = "cpu"
) -> float:
    """Fastest of ``repeats`` runs after one warm-up: the work's time without scheduling noise.

    On CUDA the clock is a pair of CUDA events around the work, read after a synchronise:
    the host returns from ``run`` once kernels are queued, long before they finish.
    """
    on_cuda = str(device).startswith("cuda")
    run()
    best = float("inf")
    for _ in range(repeats):
        if on_cuda:
            best = min(best, _cuda_seconds(run, device))
            continue
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def _cuda_seconds(run: Callable[[], object], device: torch.device | str) -> float:
    import torch

    with torch.cuda.device(device):
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record()
        run()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1000.0  # milliseconds
