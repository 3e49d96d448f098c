"""Timing on a GPU, as METHOD.md asks: warm up, CUDA events around the region, median of many.

Also the two ceilings every GPU figure is read against, measured on the card at hand rather
than taken from a datasheet: device-to-device copy bandwidth (bytes read + written) and a
large half-precision matrix product.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    median_s: float
    p10_s: float
    p90_s: float
    runs: int

    def to_json(self) -> dict[str, float | int]:
        return {
            "median_ms": round(self.median_s * 1e3, 4),
            "p10_ms": round(self.p10_s * 1e3, 4),
            "p90_ms": round(self.p90_s * 1e3, 4),
            "runs": self.runs,
        }


def time_cuda(fn: Callable[[], object], runs: int = 20, warmup: int = 3) -> Timing:
    """Each run between two events on the current stream; the host waits for every run, so
    host-side work inside ``fn`` (a step's input preparation) is counted as the engine pays it.
    Without CUDA (the bench's CPU smoke test) a host clock stands in."""
    for _ in range(warmup):
        fn()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        if not cuda:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    deciles = statistics.quantiles(times, n=10)
    return Timing(statistics.median(times), deciles[0], deciles[-1], runs)


def copy_bandwidth(device: str, nbytes: int = 4 << 30) -> float:
    """Bytes per second a device-to-device copy moves, counting bytes read plus written."""
    src = torch.randn(nbytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    timing = time_cuda(lambda: dst.copy_(src), runs=10)
    return 2 * nbytes / timing.median_s


def matmul_flops(device: str, dtype: torch.dtype, size: int = 8192) -> float:
    """FLOP/s of a ``size``-cubed product on random data (zeros run faster: METHOD.md)."""
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    timing = time_cuda(lambda: a @ b, runs=10)
    return 2 * size**3 / timing.median_s
