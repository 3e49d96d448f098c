"""Which backend a setting builds, and the clear refusals of the backends where they cannot
run (caches not on CUDA, no CuPy, no NIXL)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
import torch

from epd_engine.transfer import AVAILABLE_TRANSFER_BACKENDS, TRANSFER_BACKENDS
from epd_engine.transfer.auto import AutoBackend
from epd_engine.transfer.backend import Exports, Peer, TransferError
from epd_engine.transfer.factory import (
    TransferSettings,
    cache_memory,
    check_backend,
    make_backend,
    nccl_missing,
)
from epd_engine.transfer.memory import PrivateMemory
from tests.engine.transfer.nixl_skip import needs_nixl
from tests.engine.transfer.peers import SPEC


def test_every_name_the_api_accepts_is_built_by_this_engine() -> None:
    assert set(AVAILABLE_TRANSFER_BACKENDS) == set(TRANSFER_BACKENDS)
    assert {"cuda_ipc", "nccl", "nixl"} <= set(TRANSFER_BACKENDS)


@pytest.mark.parametrize("name", ["cuda_ipc", "nccl"])
def test_gpu_backends_are_refused_on_cpu_caches(name: str) -> None:
    with pytest.raises(ValueError, match=f"the {name} backend moves CUDA caches"):
        check_backend(name, "cpu")
    with pytest.raises(ValueError, match="moves CUDA caches"):
        cache_memory(name, "cpu")


def test_shm_is_refused_on_cuda_caches() -> None:
    with pytest.raises(ValueError, match="shm backend moves CPU caches"):
        check_backend("shm", "cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_gpu_backends_need_a_visible_gpu() -> None:
    with pytest.raises(ValueError, match="needs a CUDA device; none is visible"):
        check_backend("cuda_ipc", "cuda")


def test_nccl_without_cupy_says_what_is_missing() -> None:
    why = nccl_missing()
    try:
        import cupy  # type: ignore[import-not-found,unused-ignore]  # noqa: F401
    except ImportError:
        assert why is not None and "CuPy" in why
    else:
        assert why is None or "NCCL" in why


@pytest.mark.parametrize("name", ["auto", "tcp", "shm", "collective"])
def test_cpu_settings_keep_their_backends(name: str) -> None:
    assert check_backend(name, "cpu") is None


@asynccontextmanager
async def auto_on_cpu() -> AsyncIterator[AutoBackend]:
    """The backend ``auto`` builds over CPU caches, closed at the end."""
    memory = cache_memory("auto", "cpu")
    regions = SPEC.allocate(memory)
    async with httpx.AsyncClient() as http:
        backend = make_backend(TransferSettings(), memory, regions, Exports(), http, "t")
        try:
            assert isinstance(backend, AutoBackend)
            yield backend
        finally:
            await backend.close()


async def test_auto_on_cpu_is_shm_near_and_tcp_far_and_forwards_control_far() -> None:
    async with auto_on_cpu() as backend:
        assert (backend.near.name, backend.far.name) == ("shm", "tcp")
        assert set(backend.describe()) == {"shm", "tcp"}
        with pytest.raises(TransferError, match="tcp backend has no control operation"):
            await backend.control("connect", {})


def test_nixl_without_nixl_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> None:
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr("epd_engine.transfer.nixl_agent.import_module", missing)
    with pytest.raises(ValueError, match=r"the nixl backend needs NIXL: pip install"):
        check_backend("nixl", "cpu")


@needs_nixl
async def test_nixl_builds_on_cpu_caches_in_private_memory() -> None:
    memory = cache_memory("nixl", "cpu")
    assert isinstance(memory, PrivateMemory)  # peers read it through NIXL, not a mapping
    regions = SPEC.allocate(memory)
    async with httpx.AsyncClient() as http:
        backend = make_backend(
            TransferSettings(backend="nixl"), memory, regions, Exports(), http, "t"
        )
        try:
            info = backend.describe()["nixl"]
            names = [r["name"] for r in info["regions"]]
            assert names == [f"kv.{i}" for i in range(SPEC.num_layers)] + ["image"]
            assert info["agent"].startswith("epd-") and info["metadata"]
            with pytest.raises(TransferError, match="nixl backend has no control operation"):
                await backend.control("connect", {})
        finally:
            await backend.close()


async def test_auto_labels_a_peer_by_the_backend_it_uses_before_any_bytes_moved() -> None:
    """A pull that moved nothing (every page already here: the prefix cache) is counted under
    the backend this peer's pages would move by, never under ``auto``. Defect prevented:
    ``test_methods[EP+D-auto]`` saw pulls labelled ``auto`` when the first pull from a
    source found all its pages held."""
    async with auto_on_cpu() as backend:
        here = Peer("near-1", "http://x", backend.describe())  # this host's descriptor
        away = Peer("far-1", "http://y", {"tcp": backend.far.describe()["tcp"]})
        assert backend.label(here) == "shm"
        assert backend.label(away) == "tcp"
