"""``bench-transfer --gpu``: the GPU backends' pull of one LLaVA-1.5-7B request's caches
between two processes on this machine's GPU, against a same-process copy of the same bytes.

Per backend (``cuda_ipc``, ``nccl``, ``nixl``) a page source starts as its own process with
its caches on the GPU (``transfer_peer --device cuda``); this process builds the target side
as an engine does and times whole pulls -- the 640-token KV in layer groups of 8 (contiguous
destination pages, and the same pages scattered: the index gather/scatter path) and one
image's embeddings -- each ended by the backend's own completion event (a pull returns
only once its bytes are in place), p50/p90 over the repetitions, then checks the bytes.
The floor is one device-to-device copy of the same byte count in this process, timed by
CUDA events. NCCL refuses two ranks on one GPU: on a one-GPU machine ``nccl`` reports
``refused``. Goals (issue 18, HydraInfer): KV <= 8 ms, image <= 2 ms.

``python -m epd_engine.bench.transfer_gpu --out benchmarks/results/transfer-gpu.json``
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import httpx
import torch

from epd_engine.bench.results_file import write_results
from epd_engine.bench.transfer_peer import CacheSpec, fill
from epd_engine.bench.transfer_shapes import (
    DEFAULT_TOKENS,
    REQUEST_ID,
    TransferShape,
    llava_7b_shape,
)
from epd_engine.bench.transfer_sources import TOKEN, expose, sources
from epd_engine.slo.outcomes import LatencyStats
from epd_engine.transfer.backend import CacheRegions, Exports, PageTransfer, Peer, TransferError
from epd_engine.transfer.factory import TransferSettings, cache_memory, make_backend
from epd_engine.transfer.memory import PrivateMemory

BACKENDS = ("cuda_ipc", "nccl", "nixl")
GOALS_MS = {"kv": 8.0, "image": 2.0, "kv_scattered": 8.0}
SEED = 0
NCCL_REFUSALS = ("Duplicate GPU", "invalid usage", "INVALID_USAGE")
TIMING = (
    "wall clock of whole pulls, CUDA-synchronized before and after; "
    "floor: CUDA events around one same-process copy of the same byte count"
)


def _stats_ms(values: Sequence[float], nbytes: int) -> dict[str, float]:
    s = LatencyStats.of(values)
    gbps = nbytes / s.p50_s / 1e9 if s.p50_s else 0.0
    return {"count": s.count, "p50_ms": s.p50_s * 1e3, "p90_ms": s.p90_s * 1e3,
            "mean_ms": s.mean_s * 1e3, "GBps": gbps}  # fmt: skip


def scattered(transfers: list[PageTransfer], seed: int = SEED) -> list[PageTransfer]:
    """The same transfers into shuffled destination pages (as a busy target allocates)."""
    dst = list(transfers[0].dst_pages)
    random.Random(seed).shuffle(dst)
    return [replace(t, dst_pages=tuple(dst)) for t in transfers]


def cases(shape: TransferShape) -> dict[str, list[PageTransfer]]:
    kv = shape.kv_transfers()
    return {"kv": kv, "kv_scattered": scattered(kv), "image": shape.image_transfers()}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def floor(nbytes: int, repeats: int, warmup: int, device: str = "cuda") -> dict[str, float]:
    """One device-to-device copy of ``nbytes`` in this process (CUDA-event timing)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(warmup + repeats):
        if device != "cuda":  # the harness's CPU dry run
            started = time.perf_counter()
            dst.copy_(src)
            elapsed = time.perf_counter() - started
        else:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end) / 1e3
        if i >= warmup:
            times.append(elapsed)
    return _stats_ms(times, nbytes)


def verify(spec: CacheSpec, got: CacheRegions, transfers: dict[str, list[PageTransfer]]) -> bool:
    """The last case's pages hold the source's bytes (the seeded fill, made on CPU)."""
    want = spec.allocate(PrivateMemory(torch.device("cpu")))
    fill(want, SEED)
    ok = True
    for transfer in transfers["kv_scattered"]:
        src, dst = list(transfer.src_pages), list(transfer.dst_pages)
        for layer in range(transfer.layer_start, transfer.layer_stop):
            ok &= torch.equal(got.kv[layer][dst].cpu().view(torch.uint8),
                              want.kv[layer][src].view(torch.uint8))  # fmt: skip
    assert got.image is not None and want.image is not None
    return ok and torch.equal(got.image.cpu().view(torch.uint8), want.image.view(torch.uint8))


async def _measure(
    name: str, shape: TransferShape, peer: Peer, repeats: int, warmup: int, device: str
) -> dict[str, Any]:
    memory = cache_memory(name, device)
    regions = shape.spec.allocate(memory)
    for tensor in [*regions.kv, *([regions.image] if regions.image is not None else [])]:
        tensor.fill_(-7.0)  # poisoned: verify sees only what arrived
    out: dict[str, Any] = {}
    async with httpx.AsyncClient() as http:
        backend = make_backend(TransferSettings(backend=name), memory, regions, Exports(), http,
                               TOKEN)  # fmt: skip
        try:
            by_case = cases(shape)
            for case, transfers in by_case.items():
                nbytes = sum(shape.nbytes(t) for t in transfers)
                times = []
                for i in range(warmup + repeats):
                    sync(device)
                    started = time.perf_counter()
                    for transfer in transfers:  # one after another, as the engine pulls
                        await backend.pull(peer, transfer)
                    sync(device)
                    if i >= warmup:
                        times.append(time.perf_counter() - started)
                stats = _stats_ms(times, nbytes)
                out[case] = {"bytes": nbytes, "num_transfers": len(transfers), **stats,
                             "goal_ms": GOALS_MS[case],
                             "goal_met": stats["p50_ms"] <= GOALS_MS[case]}  # fmt: skip
            out["verified"] = verify(shape.spec, regions, by_case)
        finally:
            await backend.close()
    return out


def bench_backend(
    name: str, shape: TransferShape, repeats: int, warmup: int, run_dir: Path, device: str
) -> dict[str, Any]:
    try:
        with sources(shape.spec, [name], run_dir / name, SEED, link_peer=False,
                     device=device) as started:  # fmt: skip
            return _bench_source(name, shape, started.peers[name], repeats, warmup, device)
    except (RuntimeError, TimeoutError) as exc:  # the source did not start (its log says why)
        return {"error": f"source: {str(exc)[-500:]}"}


def _bench_source(
    name: str, shape: TransferShape, peer: Peer, repeats: int, warmup: int, device: str
) -> dict[str, Any]:
    expose(peer, "kv", list(range(shape.num_kv_pages)), REQUEST_ID)
    expose(peer, "image", [0], REQUEST_ID)
    try:
        return asyncio.run(_measure(name, shape, peer, repeats, warmup, device))
    except TransferError as exc:
        if name == "nccl" and any(r in str(exc) for r in NCCL_REFUSALS):
            return {"refused": f"one GPU: NCCL will not put two ranks on it ({exc})"}
        return {"error": str(exc)}
    except (ValueError, RuntimeError) as exc:  # refused at build (no CuPy, ...)
        return {"error": f"{type(exc).__name__}: {exc}"}


def run(
    backends: Sequence[str],
    repeats: int,
    warmup: int,
    run_dir: Path,
    device: str = "cuda",
    num_tokens: int = DEFAULT_TOKENS,
) -> dict[str, Any]:
    shape = llava_7b_shape(num_tokens)
    info: dict[str, Any] = {
        "name": shape.name,
        "cache": asdict(shape.spec),
        "num_tokens": shape.num_tokens,
        "layers_per_group": shape.layers_per_group,
        "kv_bytes": sum(shape.nbytes(t) for t in shape.kv_transfers()),
        "image_bytes": sum(shape.nbytes(t) for t in shape.image_transfers()),
    }
    started = time.monotonic()
    report: dict[str, Any] = {
        "kind": "epd-bench-transfer-gpu",
        "version": 1,
        "gpu": torch.cuda.get_device_name() if device == "cuda" else device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "config": {"repeats": repeats, "warmup": warmup, "timing": TIMING},
        "shape": info,
        "floor": {c: floor(info[f"{c}_bytes"], repeats, warmup, device) for c in ("kv", "image")},
        "backends": {},
    }
    for name in backends:
        report["backends"][name] = bench_backend(name, shape, repeats, warmup, run_dir, device)
    report["wall_s"] = round(time.monotonic() - started, 1)
    return report


def format_table(report: dict[str, Any]) -> str:
    head = f"{'backend':<10} {'case':<13} {'p50 ms':>8} {'p90 ms':>8} {'GB/s':>7} {'goal':>6}"
    tokens = report["shape"]["num_tokens"]
    lines = [f"GPU: {report['gpu']}  (LLaVA-1.5-7B, {tokens} tokens)", head]
    for case in ("kv", "image"):
        f = report["floor"][case]
        lines.append(f"{'floor':<10} {case:<13} {f['p50_ms']:8.3f} {f['p90_ms']:8.3f} "
                     f"{f['GBps']:7.1f}")  # fmt: skip
    for name, result in report["backends"].items():
        if "kv" not in result:
            lines.append(f"{name:<10} {result.get('refused') or result.get('error')}")
            continue
        for case in ("kv", "kv_scattered", "image"):
            c = result[case]
            mark = "ok" if c["goal_met"] else "MISS"
            lines.append(f"{name:<10} {case:<13} {c['p50_ms']:8.3f} {c['p90_ms']:8.3f} "
                         f"{c['GBps']:7.1f} {mark:>6}")  # fmt: skip
        if not result["verified"]:
            lines.append(f"{name:<10} BYTES DIFFER from the source's")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated")
    p.add_argument("--repeats", type=int, default=30, help="timed pulls per case (>= 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed pulls first (connect, open)")
    p.add_argument("--out", type=Path, help="JSON results file")
    p.add_argument("--run-dir", type=Path, help="source process logs (default: temp)")
    p.add_argument("--num-tokens", type=int, default=DEFAULT_TOKENS, help="KV tokens (640)")
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: harness dry run
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench-transfer --gpu: no CUDA device visible")
        return 2
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    known = BACKENDS if args.device == "cuda" else ("shm", "collective", "tcp", "nixl")
    unknown = [b for b in backends if b not in known]
    if unknown or args.repeats < 1:
        p.error(f"unknown backends {unknown}" if unknown else "--repeats must be >= 1")
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="epd-bench-transfer-gpu-"))
    report = run(backends, args.repeats, args.warmup, run_dir, args.device, args.num_tokens)
    print(format_table(report))
    if args.out:
        print(f"results: {write_results(args.out, report)}")
    ran = [r for r in report["backends"].values() if "kv" in r]
    failed = any("error" in r for r in report["backends"].values())
    return 0 if all(r["verified"] for r in ran) and not failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
