"""Can NCCL (through CuPy) form a two-rank group here, and on which GPUs? Two processes,
one NcclCommunicator, one send/recv of 64 MiB; prints what NCCL said. With one GPU both
ranks share it, which NCCL normally refuses ("Duplicate GPU detected")."""

from __future__ import annotations

import multiprocessing as mp
import sys
import time


def rank_main(rank: int, gpu: int, ids: mp.Queue, results: mp.Queue) -> None:
    try:
        import cupy
        from cupy.cuda import nccl

        cupy.cuda.Device(gpu).use()
        if rank == 0:
            uid = nccl.get_unique_id()
            ids.put(list(uid))
        else:
            uid = bytes(v & 0xFF for v in ids.get(timeout=30))  # CuPy 14 takes bytes
        comm = nccl.NcclCommunicator(2, uid, rank)
        buf = cupy.full(32 << 20, rank, dtype=cupy.float16)
        stream = cupy.cuda.Stream.null
        start = time.perf_counter()
        if rank == 0:
            comm.send(buf.data.ptr, buf.size, nccl.NCCL_FLOAT16, 1, stream.ptr)
        else:
            comm.recv(buf.data.ptr, buf.size, nccl.NCCL_FLOAT16, 0, stream.ptr)
        stream.synchronize()
        ok = rank == 0 or bool((buf == 0).all())
        results.put((rank, f"ok={ok} {time.perf_counter() - start:.4f} s"))
    except BaseException as exc:  # report whatever NCCL or CuPy raised, with its type
        results.put((rank, f"{type(exc).__module__}.{type(exc).__name__}: {exc}"))


def main() -> int:
    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    gpus = (0, 1) if count > 1 else (0, 0)
    print(f"{count} GPU(s); ranks on GPUs {gpus}", flush=True)
    ctx = mp.get_context("spawn")
    ids, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, g, ids, results)) for r, g in enumerate(gpus)]
    for p in procs:
        p.start()
    for _ in procs:
        try:
            rank, said = results.get(timeout=60)
            print(f"rank {rank}: {said}", flush=True)
        except Exception as exc:  # a rank hung inside NCCL
            print(f"no answer: {exc!r}", flush=True)
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
