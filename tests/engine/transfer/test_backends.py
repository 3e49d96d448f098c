"""Every backend moves pages between two processes exactly, refuses what it must, and
fails cleanly (never hangs, leaks nothing) when the source dies.

The source is ``epd_engine.bench.transfer_peer`` (caches of a small shape with seeded
random pages, the real backend, the real HTTP control routes) rather than an engine: the
model plays no part in moving pages. Engines migrating over every backend are covered by
``tests/engine/disagg``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import torch

from epd_engine.bench.transfer_peer import fill
from epd_engine.request import CacheKind
from epd_engine.transfer.auto import AutoBackend
from epd_engine.transfer.backend import PageTransfer, Peer, TransferError
from epd_engine.transfer.memory import PrivateMemory
from tests.engine.transfer.nixl_skip import NIXL_MISSING, backend_param
from tests.engine.transfer.peers import (
    SEED,
    SPEC,
    Source,
    expose,
    source_processes,
    target_backend,
)

pytestmark = pytest.mark.slow
# nixl where NIXL is installed (the dev extra has it); its tests say why they skip elsewhere
BACKENDS = ["tcp", "shm", "collective", "auto", *(["nixl"] if NIXL_MISSING is None else [])]
EVERY_BACKEND = ["tcp", "shm", "collective", "auto", backend_param("nixl")]


def reference() -> tuple[list[torch.Tensor], torch.Tensor]:
    """What the source holds: the same seeded fill on private memory."""
    regions = SPEC.allocate(PrivateMemory(torch.device("cpu")))
    fill(regions, SEED)
    assert regions.image is not None
    return regions.kv, regions.image


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Source]]:
    with source_processes(BACKENDS, tmp_path_factory.mktemp("sources")) as started:
        yield started


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as client:
        yield client


@pytest.mark.parametrize("name", EVERY_BACKEND)
async def test_pages_arrive_exactly_where_named(
    name: str, sources: dict[str, Source], http: httpx.AsyncClient
) -> None:
    peer = sources[name].peer
    backend, regions = target_backend(name, http)
    kv, image = reference()
    src, dst = (3, 4, 5, 9), (0, 1, 7, 8)
    expose(peer, "kv", list(src))
    expose(peer, "image", [2])
    try:
        for lo, hi in [(0, 2), (2, 4), (4, 5)]:  # three layer groups
            await backend.pull(peer, PageTransfer("bench", CacheKind.KV, src, dst, lo, hi))
        await backend.pull(peer, PageTransfer("bench", CacheKind.IMAGE, (2,), (0,)))
    finally:
        await backend.close()
    untouched = [p for p in range(SPEC.num_kv_pages) if p not in dst]
    for layer in range(SPEC.num_layers):
        assert torch.equal(regions.kv[layer][list(dst)], kv[layer][list(src)]), layer
        assert not regions.kv[layer][untouched].any()
    assert regions.image is not None
    assert torch.equal(regions.image[0], image[2]) and not regions.image[1:].any()


@pytest.mark.parametrize("name", ["tcp", "collective"])
async def test_pages_no_request_exposes_are_refused(
    name: str, sources: dict[str, Source], http: httpx.AsyncClient
) -> None:
    peer = sources[name].peer
    backend, regions = target_backend(name, http)
    expose(peer, "kv", [1, 2], request_id="refusals")
    try:
        with pytest.raises(TransferError, match="outside"):
            await backend.pull(peer, PageTransfer("refusals", CacheKind.KV, (1, 3), (0, 1)))
        with pytest.raises(TransferError, match="no migrating"):
            await backend.pull(peer, PageTransfer("unknown", CacheKind.KV, (1,), (0,)))
        assert not regions.kv[0].any()
        # a refusal leaves the connection usable
        await backend.pull(peer, PageTransfer("refusals", CacheKind.KV, (1, 2), (0, 1)))
    finally:
        await backend.close()
    assert regions.kv[0][0].any()


@pytest.mark.parametrize("name", ["tcp", "shm"])
async def test_a_wrong_token_gets_nothing(
    name: str, sources: dict[str, Source], http: httpx.AsyncClient
) -> None:
    peer = sources[name].peer
    backend, regions = target_backend(name, http, token="not-the-token")
    expose(peer, "kv", [1], request_id="token")
    try:
        with pytest.raises(TransferError):
            await backend.pull(peer, PageTransfer("token", CacheKind.KV, (1,), (0,)))
    finally:
        await backend.close()
    assert not regions.kv[0].any()


async def test_auto_maps_a_same_host_peer_and_falls_back_to_tcp_otherwise(
    sources: dict[str, Source], http: httpx.AsyncClient
) -> None:
    peer = sources["auto"].peer
    expose(peer, "kv", [1], request_id="auto")
    backend, _ = target_backend("auto", http)
    assert isinstance(backend, AutoBackend)
    shm_info = {**peer.descriptor["shm"], "socket": "no-such-socket"}
    unreachable = Peer("elsewhere", peer.url, {**peer.descriptor, "shm": shm_info})
    try:
        await backend.pull(peer, PageTransfer("auto", CacheKind.KV, (1,), (0,)))
        await backend.pull(unreachable, PageTransfer("auto", CacheKind.KV, (1,), (1,)))
        assert backend.label(peer) == "shm"
        assert backend.label(unreachable) == "tcp"  # its connect failed: tcp for good
    finally:
        await backend.close()


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


async def test_a_source_killed_between_pulls_fails_the_next_pull_cleanly(
    tmp_path: Path, http: httpx.AsyncClient
) -> None:
    before = shm_entries()
    with source_processes(BACKENDS, tmp_path) as victims:
        for name, victim in victims.items():
            peer = victim.peer
            backend, _ = target_backend(name, http)
            expose(peer, "kv", [1, 2])
            try:
                await backend.pull(peer, PageTransfer("bench", CacheKind.KV, (1, 2), (0, 1)))
                os.killpg(victim.process.pid, signal.SIGKILL)
                victim.process.wait()
                started = time.monotonic()
                with pytest.raises(TransferError):
                    transfer = PageTransfer("bench", CacheKind.KV, (1, 2), (2, 3))
                    await asyncio.wait_for(backend.pull(peer, transfer), 60)
                assert time.monotonic() - started < 45, name  # bounded by the backend timeout
                backend.forget(peer.instance_id)
            finally:
                await backend.close()
    assert shm_entries() <= before  # memfd regions never appear in /dev/shm
