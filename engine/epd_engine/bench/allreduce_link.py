"""The link a tensor-parallel instance's ranks reduce over, measured: ``size`` processes on
this host join a group (gloo on a CPU, NCCL on GPUs, as ``parallel/ranks.py`` does) and time
all-reduces of one hidden row (the latency) and of many rows (the bandwidth), the shapes a
step's collectives have. The fit is ``LinkCoeffs``: a reduce of B bytes costs ``latency_s +
2 (size - 1) / size x B / bytes_per_s`` (a ring), as ``profiler/tensor_parallel.py`` charges it.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from epd_engine.profiler.links import LinkCoeffs

SMALL_ROWS = 1
LARGE_ROWS = 4096


def measure_allreduce_link(
    size: int, hidden_size: int, dtype: torch.dtype, device: str = "cpu", repeats: int = 20
) -> LinkCoeffs:
    """All-reduce latency and bus bandwidth among ``size`` fresh processes."""
    context = mp.get_context("spawn")
    results = context.Queue()
    store = dist.TCPStore("127.0.0.1", 0, world_size=size, is_master=True,
                          wait_for_workers=False, timeout=timedelta(seconds=120))  # fmt: skip
    args = (size, store.port, hidden_size, dtype, device, repeats, results)
    ranks = [context.Process(target=_rank, args=(r, *args)) for r in range(size)]
    for process in ranks:
        process.start()
    small_s, large_s = results.get(timeout=300)
    for process in ranks:
        process.join(timeout=30)
    ring = 2 * (size - 1) / size
    large_bytes = LARGE_ROWS * hidden_size * torch.empty((), dtype=dtype).element_size()
    bandwidth = ring * large_bytes / max(large_s - small_s, 1e-9)
    return LinkCoeffs(latency_s=small_s, bytes_per_s=bandwidth)


def _rank(
    rank: int, size: int, port: int, hidden: int, dtype: torch.dtype, device: str,
    repeats: int, results: mp.Queue,
) -> None:  # fmt: skip
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size=size, is_master=False)
    on_gpu = device.startswith("cuda")
    if on_gpu:
        device = f"cuda:{rank}"
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_gpu else "gloo", store=store, rank=rank,
                            world_size=size)  # fmt: skip
    timings = [_best(torch.ones(rows, hidden, dtype=dtype, device=device), repeats, on_gpu)
               for rows in (SMALL_ROWS, LARGE_ROWS)]  # fmt: skip
    if rank == 0:
        results.put(tuple(timings))
    dist.barrier()
    dist.destroy_process_group()


def _best(tensor: torch.Tensor, repeats: int, on_gpu: bool) -> float:
    """The median of ``repeats`` all-reduces after two to warm up (every rank runs the same
    count, so they stay in step)."""
    times = []
    for i in range(repeats + 2):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        if on_gpu:
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]
