"""The GPU backends between two processes on one GPU: ``cuda_ipc``, ``nccl`` and ``nixl`` pull pages
whose bytes are identical to the source's (random pages; the destination poisoned first,
untouched pages must stay poisoned), through slice copies and the index gather/scatter.

NCCL refuses two ranks of one group on one GPU ("Duplicate GPU", invalid usage): on a
one-GPU machine the nccl test then skips with that reason. Run on a GPU with
``pytest -m gpu tests/engine/transfer/test_gpu_backends.py``.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import httpx
import pytest
import torch

from epd_engine.bench.transfer_peer import CacheSpec, fill
from epd_engine.request import CacheKind
from epd_engine.transfer.backend import CacheRegions, PageTransfer, TransferError
from epd_engine.transfer.memory import PrivateMemory
from tests.engine.transfer.nixl_skip import backend_param, needs_nixl
from tests.engine.transfer.peers import SEED, expose, source_processes, target_backend

SPEC = CacheSpec(num_layers=5, num_kv_pages=12, num_image_pages=4, dtype="float16")
POISON = -7.0
# (src, dst) per pull: 3 runs (slice copies), then 6 runs (index gather/scatter)
PULLS = [((3, 4, 5, 9), (0, 1, 7, 8)), ((0, 2, 4, 6, 10, 11), (2, 3, 4, 5, 6, 9))]
NCCL_REFUSALS = ("Duplicate GPU", "invalid usage", "INVALID_USAGE")


def reference() -> CacheRegions:
    regions = SPEC.allocate(PrivateMemory(torch.device("cpu")))
    fill(regions, SEED)  # the same seeded pages the source made (generated on CPU)
    return regions


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


async def pull_and_check(name: str, tmp_path: Path, device: str = "cuda") -> str | None:
    """None when every check passed; the reason when NCCL refused the one-GPU pair."""
    async with httpx.AsyncClient() as http:
        return await _pull_and_check(name, http, tmp_path, device)


async def _pull_and_check(
    name: str, http: httpx.AsyncClient, tmp_path: Path, device: str
) -> str | None:
    with source_processes([name], tmp_path, SPEC, device=device) as sources:
        source = sources[name]
        peer = source.peer
        backend, regions = target_backend(name, http, SPEC, device=device)
        assert regions.image is not None and regions.kv[0].device.type == device
        for tensor in [*regions.kv, regions.image]:
            tensor.fill_(POISON)
        for i, (src, _) in enumerate(PULLS):
            expose(peer, "kv", list(src), request_id=f"r{i}")
        expose(peer, "image", [2], request_id="r0")
        try:
            try:
                for i, (src, dst) in enumerate(PULLS):
                    for lo, hi in [(0, 2), (2, 5)]:
                        transfer = PageTransfer(f"r{i}", CacheKind.KV, src, dst, lo, hi)
                        await backend.pull(peer, transfer)
            except TransferError as exc:
                if name == "nccl" and any(r in str(exc) for r in NCCL_REFUSALS):
                    return f"refused: one GPU (NCCL will not put two ranks on it): {exc}"
                raise
            await backend.pull(peer, PageTransfer("r0", CacheKind.IMAGE, (2,), (1,)))
            if device == "cuda":
                torch.cuda.synchronize()
            want = reference()
            written = [d for _, dst in PULLS for d in dst]
            untouched = [p for p in range(SPEC.num_kv_pages) if p not in written]
            for layer in range(SPEC.num_layers):
                got = regions.kv[layer].cpu()
                for src, dst in PULLS:
                    assert same_bytes(got[list(dst)], want.kv[layer][list(src)]), layer
                assert bool((got[untouched] == POISON).all()), layer
            image = regions.image.cpu()
            assert want.image is not None and same_bytes(image[1], want.image[2])
            assert bool((image[[0, 2, 3]] == POISON).all())
            # the source dies: the next pull fails cleanly (no hang, no crash here)
            os.killpg(source.process.pid, signal.SIGKILL)
            source.process.wait()
            with pytest.raises(TransferError):
                src, dst = PULLS[0]
                await backend.pull(peer, PageTransfer("r0", CacheKind.KV, src, dst, 0, 1))
        finally:
            await backend.close()
    return None


# Plain tests around asyncio.run: the GPU machine need not have pytest-asyncio.
@pytest.mark.gpu
def test_cuda_ipc_pulls_exact_bytes_between_processes(tmp_path: Path) -> None:
    assert asyncio.run(pull_and_check("cuda_ipc", tmp_path)) is None


@pytest.mark.gpu
def test_nccl_pulls_exact_bytes_between_processes(tmp_path: Path) -> None:
    pytest.importorskip("cupy", reason="the nccl backend needs CuPy")
    refused = asyncio.run(pull_and_check("nccl", tmp_path))
    if refused is not None:
        pytest.skip(refused)


# UCX picks its transports (cuda_ipc on one GPU); tcp,cuda_copy is what two pods without an
# RDMA device leave it: device pages staged through host memory over TCP.
@pytest.mark.gpu
@needs_nixl
@pytest.mark.parametrize("ucx_tls", ["", "tcp,cuda_copy"], ids=["ucx-choice", "tcp"])
def test_nixl_pulls_exact_bytes_between_processes(
    ucx_tls: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if ucx_tls:
        monkeypatch.setenv("UCX_TLS", ucx_tls)  # the source process inherits it
    assert asyncio.run(pull_and_check("nixl", tmp_path)) is None


@pytest.mark.slow
@pytest.mark.parametrize("name", ["shm", "collective", backend_param("nixl")])
def test_the_same_checks_hold_for_the_cpu_twins(name: str, tmp_path: Path) -> None:
    """Runs without a GPU: the checks above are sound (shm is cuda_ipc's twin, collective
    runs nccl's protocol, nixl is the same backend on CPU memory)."""
    assert asyncio.run(pull_and_check(name, tmp_path, device="cpu")) is None
