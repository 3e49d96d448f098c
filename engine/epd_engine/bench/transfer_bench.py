"""``bench-transfer``: whole pulls through each real backend, across processes, divided by
the physical limit of the same bytes measured in the same run.

Per shape (``transfer_shapes``) the sources start as processes (``transfer_sources``); the
target is this process, building each backend as an engine does (``make_backend`` over
caches of the same shape). Per backend and case -- the request's KV in layer groups, one
image, one page of one layer (the per-transfer overhead) -- every repetition times one whole
pull and then the backend's limit (``link_limits``) on the same message sizes, so the two
see the same moment's load; ratios are limit time / pull time at the p50 (= bandwidth
ratio), plus the spread of the per-repetition ratio.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from epd_engine.bench.link_limits import Limit, limit_for
from epd_engine.bench.transfer_peer import fill
from epd_engine.bench.transfer_shapes import REQUEST_ID, TransferShape
from epd_engine.bench.transfer_sources import TOKEN, expose, sources
from epd_engine.slo.outcomes import LatencyStats
from epd_engine.transfer.backend import CacheRegions, Exports, PageTransfer, Peer
from epd_engine.transfer.factory import TransferSettings, cache_memory, make_backend
from epd_engine.transfer.memory import PrivateMemory

BACKENDS = ("tcp", "shm", "collective", "nixl")  # auto is shm on one host, tcp across hosts
SERVED_BY = {"tcp": "auto", "shm": "auto"}  # link_timings: an auto source serves both
GOALS = {  # issue 11: bandwidth as a share of the backend's physical limit
    "shm": ("memcpy", 0.5),
    "tcp": ("raw_socket", 0.5),
    "collective": ("raw_gloo", 0.8),
    # on one host UCX reads with one kernel copy (CMA: process_vm_readv), so memcpy bounds it
    "nixl": ("memcpy", 0.5),
}
CASES = ("kv", "image", "page")
SEED = 0


@dataclass(frozen=True)
class Repeats:
    bulk: int = 20  # timed whole KV and image pulls per backend
    page: int = 100  # timed one-page pulls per backend
    warmup: int = 3  # untimed first (connect, map, page faults)


Progress = Callable[[int], None]


def transfers_of(shape: TransferShape, case: str) -> list[PageTransfer]:
    if case == "kv":
        return shape.kv_transfers()
    if case == "image":
        return shape.image_transfers()
    return shape.page_transfers()


def _stats(values: Sequence[float]) -> dict[str, float]:
    s = LatencyStats.of(values)
    return {"count": s.count, "p50_s": s.p50_s, "p90_s": s.p90_s, "mean_s": s.mean_s}


def case_report(nbytes: int, pulls: Sequence[float], limits: Sequence[float]) -> dict[str, Any]:
    pull = _stats(pulls)
    pull["bandwidth_Bps"] = nbytes / pull["p50_s"]
    out: dict[str, Any] = {"bytes": nbytes, "pull": pull}
    if limits:
        limit = _stats(limits)
        limit["bandwidth_Bps"] = nbytes / limit["p50_s"]
        paired = np.asarray(limits) / np.asarray(pulls)
        p10, p50, p90 = (float(x) for x in np.percentile(paired, [10, 50, 90]))
        out["limit"] = limit
        out["ratio"] = limit["p50_s"] / pull["p50_s"]
        out["paired_ratio"] = {"p10": p10, "p50": p50, "p90": p90}
    return out


async def _pull_all(backend: Any, peer: Peer, transfers: Sequence[PageTransfer]) -> float:
    started = time.perf_counter()
    for transfer in transfers:  # one after another, as a migration target pulls a request
        await backend.pull(peer, transfer)
    return time.perf_counter() - started


def _time_limit(limit: Limit, sizes: Sequence[int]) -> float:
    started = time.perf_counter()
    limit.run(sizes)
    return time.perf_counter() - started


async def measure_backend(
    shape: TransferShape,
    name: str,
    peer: Peer,
    limit: Limit | None,
    repeats: Repeats,
    progress: Progress = lambda n: None,
    cases: Sequence[str] = CASES,
) -> tuple[dict[str, Any], CacheRegions]:
    """Each case's pull (and limit) timings; also the target's caches, to verify."""
    memory = cache_memory(name, "cpu")
    regions = shape.spec.allocate(memory)
    async with httpx.AsyncClient() as http:
        settings = TransferSettings(backend=name)
        backend = make_backend(settings, memory, regions, Exports(), http, TOKEN)
        report: dict[str, Any] = {}
        try:
            for case in cases:
                transfers = transfers_of(shape, case)
                sizes = [shape.nbytes(t) for t in transfers]
                count = repeats.page if case == "page" else repeats.bulk
                pulls, limits = [], []
                for i in range(repeats.warmup + count):
                    pulled_s = await _pull_all(backend, peer, transfers)
                    limit_s = _time_limit(limit, sizes) if limit is not None else None
                    if i >= repeats.warmup:
                        pulls.append(pulled_s)
                        if limit_s is not None:
                            limits.append(limit_s)
                    progress(1)
                report[case] = {
                    **case_report(sum(sizes), pulls, limits),
                    "num_transfers": len(transfers),
                }
        finally:
            await backend.close()
    return report, regions


def reference(shape: TransferShape) -> CacheRegions:
    """What every source holds: the same seeded fill on private memory."""
    regions = shape.spec.allocate(PrivateMemory(torch.device("cpu")))
    fill(regions, SEED)
    return regions


def verify(shape: TransferShape, got: CacheRegions, want: CacheRegions) -> bool:
    """The request's KV pages and the image arrived exactly."""
    pages = shape.num_kv_pages
    same_kv = all(torch.equal(g[:pages], w[:pages]) for g, w in zip(got.kv, want.kv, strict=True))
    return same_kv and got.image is not None and torch.equal(got.image, want.image)  # type: ignore[arg-type]


def expose_request(peer: Peer, shape: TransferShape) -> None:
    expose(peer, "kv", list(range(shape.num_kv_pages)), REQUEST_ID)
    expose(peer, "image", [0], REQUEST_ID)


def shape_info(shape: TransferShape) -> dict[str, Any]:
    kv = sum(shape.nbytes(t) for t in shape.kv_transfers())
    return {
        "name": shape.name,
        "cache": asdict(shape.spec),
        "num_tokens": shape.num_tokens,
        "layers_per_group": shape.layers_per_group,
        "kv_bytes": kv,
        "image_bytes": sum(shape.nbytes(t) for t in shape.image_transfers()),
        "page_bytes": shape.nbytes(shape.page_transfers()[0]),
    }


def bench_shape(
    shape: TransferShape,
    backends: Sequence[str],
    repeats: Repeats,
    log_dir: Path,
    progress: Progress = lambda n: None,
) -> dict[str, Any]:
    """Every backend on one shape, each against its limit; the bytes checked once each."""
    want = reference(shape)
    out: dict[str, Any] = {**shape_info(shape), "backends": {}}
    max_bytes = max(out["kv_bytes"], out["image_bytes"], out["page_bytes"])
    with sources(shape.spec, backends, log_dir / shape.name, SEED) as started:
        for name in backends:
            peer = started.peers[name]
            expose_request(peer, shape)
            limit = limit_for(name, started.link_port, max_bytes)
            try:
                cases, got = asyncio.run(measure_backend(shape, name, peer, limit, repeats,
                                                         progress))  # fmt: skip
            finally:
                limit.close()
            limit_name, goal = GOALS[name]
            for case in ("kv", "image"):
                cases[case]["goal"] = goal
                cases[case]["goal_met"] = cases[case]["ratio"] >= goal
            out["backends"][name] = {"limit": limit_name, "verified": verify(shape, got, want),
                                     **cases}  # fmt: skip
            del got
    return out


def num_steps(num_shapes: int, backends: Sequence[str], repeats: Repeats) -> int:
    per_backend = 2 * (repeats.warmup + repeats.bulk) + repeats.warmup + repeats.page
    return num_shapes * len(backends) * per_backend


def summary(shapes: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per shape, backend and bulk case: the ratio and whether it meets the goal."""
    rows = []
    for shape in shapes:
        for name, result in shape["backends"].items():
            for case in ("kv", "image"):
                c = result[case]
                row = {"shape": shape["name"], "backend": name, "case": case}
                rows.append({**row, "ratio": c["ratio"], "goal": c["goal"], "met": c["goal_met"]})
    return rows


def link_timings(
    shape: TransferShape,
    backends: Sequence[str],
    repeats: Repeats,
    log_dir: Path,
    progress: Progress = lambda n: None,
) -> dict[str, dict[str, Any]]:
    """KV and one-page pull timings per backend, no limits (``profile-costs``' link figures).
    One ``auto`` source serves both tcp and shm pulls: a process fewer to start."""
    names = sorted({SERVED_BY.get(b, b) for b in backends})
    out = {}
    with sources(shape.spec, names, log_dir, SEED, link_peer=False) as started:
        for name in backends:
            peer = started.peers[SERVED_BY.get(name, name)]
            expose_request(peer, shape)
            report, _ = asyncio.run(measure_backend(shape, name, peer, None, repeats, progress,
                                                    cases=("kv", "page")))  # fmt: skip
            out[name] = report
    return out
