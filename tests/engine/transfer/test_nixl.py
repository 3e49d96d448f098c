"""The ``nixl`` backend beyond what every backend passes (``test_backends``): descriptors from
page runs, a stalled source (its read times out and no late byte lands in our pages), and
an idle agent that does not spin a core."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from epd_engine.request import CacheKind
from epd_engine.transfer.backend import PageTransfer, TransferError
from epd_engine.transfer.memory import PrivateMemory
from epd_engine.transfer.nixl import NixlBackend, RemoteRegion, read_rows
from tests.engine.transfer.nixl_skip import needs_nixl
from tests.engine.transfer.peers import SPEC, expose, source_processes


def test_rows_follow_the_runs_consecutive_on_both_sides() -> None:
    layers = [torch.zeros(8, 2, 4) for _ in range(2)]  # 32-byte pages
    page = 32
    src = [RemoteRegion(f"kv.{i}", 1_000_000 * (i + 1), page, 10, 0) for i in range(2)]
    ours, theirs = read_rows(src, layers, (3, 4, 5, 9), (0, 1, 2, 6))
    assert theirs.tolist() == [
        [1_000_000 + 3 * page, 3 * page, 0], [1_000_000 + 9 * page, page, 0],
        [2_000_000 + 3 * page, 3 * page, 0], [2_000_000 + 9 * page, page, 0],
    ]  # fmt: skip
    base = [layer.data_ptr() for layer in layers]
    assert ours.tolist() == [
        [base[0], 3 * page, 0], [base[0] + 6 * page, page, 0],
        [base[1], 3 * page, 0], [base[1] + 6 * page, page, 0],
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("region", "src", "dst", "match"),
    [
        (RemoteRegion("kv.0", 4096, 64, 10, 0), (0,), (0,), "64-byte source pages"),
        (RemoteRegion("kv.0", 4096, 32, 10, 0), (9, 10), (0, 1), "outside"),
        (RemoteRegion("kv.0", 4096, 32, 10, 0), (0, 1), (7, 8), "outside"),
        (RemoteRegion("kv.0", 4096, 32, 10, 0), (0, 1), (0,), "destination pages"),
    ],
)
def test_rows_refuse_what_cannot_be_read(
    region: RemoteRegion, src: tuple[int, ...], dst: tuple[int, ...], match: str
) -> None:
    with pytest.raises(TransferError, match=match):
        read_rows([region], [torch.zeros(8, 2, 4)], src, dst)


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@needs_nixl
@pytest.mark.slow
async def test_a_stalled_source_times_out_and_writes_nothing_late(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over UCX's tcp transport a read needs the source's progress thread: SIGSTOP holds it.
    Releasing the read would not stop UCX once the source resumes; the backend retires its
    agent instead, so nothing lands after the failure, and pulls from other peers go on
    through a fresh agent. (The stalled source itself aborts on resume, its reader gone:
    UCX's "Endpoint timeout"; its requests are retried as for any dead instance.)"""
    monkeypatch.setenv("UCX_TLS", "tcp")  # both processes: the sources inherit it
    (tmp_path / "stalled").mkdir()
    (tmp_path / "healthy").mkdir()
    with (
        source_processes(["nixl"], tmp_path / "stalled") as stalled,
        source_processes(["nixl"], tmp_path / "healthy") as healthy,
    ):
        victim = stalled["nixl"]
        regions = SPEC.allocate(PrivateMemory(torch.device("cpu")))
        backend = NixlBackend(regions, timeout_s=2.0)
        pages = tuple(range(SPEC.num_kv_pages))
        for source in (victim, healthy["nixl"]):
            expose(source.peer, "kv", list(pages))
        first_agent = backend.describe()["nixl"]["agent"]
        try:
            await backend.pull(victim.peer, PageTransfer("bench", CacheKind.KV, (1,), (0,)))
            assert regions.kv[0][0].any()
            os.killpg(victim.process.pid, signal.SIGSTOP)
            while not stopped(victim.process.pid):
                time.sleep(0.01)
            started = time.monotonic()
            stalled_read = PageTransfer("bench", CacheKind.KV, pages, pages, 1, 5)
            with pytest.raises(TransferError, match="still running"):
                await backend.pull(victim.peer, stalled_read)
            assert time.monotonic() - started < 10
            assert backend.describe()["nixl"]["agent"] != first_agent  # a fresh agent
            after_failure = [regions.kv[layer].clone() for layer in range(1, 5)]
            os.killpg(victim.process.pid, signal.SIGCONT)
            time.sleep(1.0)  # the source answers the abandoned read now, into nothing
            for layer, before in zip(range(1, 5), after_failure, strict=True):
                assert torch.equal(regions.kv[layer], before), layer
            await backend.pull(healthy["nixl"].peer, PageTransfer("bench", CacheKind.KV,
                                                                  pages, pages, 1, 5))  # fmt: skip
            assert all(regions.kv[layer].any() for layer in range(1, 5))
        finally:
            os.killpg(victim.process.pid, signal.SIGCONT)
            await backend.close()


@needs_nixl
def test_an_idle_agent_leaves_the_cpu_alone() -> None:
    """NIXL's wrapper polls UCX with no delay (a core at 100%); ours waits on the worker's
    event fd with a 1 ms timeout."""
    regions = SPEC.allocate(PrivateMemory(torch.device("cpu")))
    backend = NixlBackend(regions)
    try:
        time.sleep(0.5)  # start-up work done
        before = time.process_time()
        time.sleep(2.0)
        used_s = time.process_time() - before
    finally:
        asyncio.run(backend.close())
    assert used_s < 0.2, f"{used_s:.2f} s of CPU in 2 s idle"
