"""Which backend a setting builds, and the clear refusals of the GPU backends where they
cannot run (caches not on CUDA, no CuPy)."""

from __future__ import annotations

import httpx
import pytest
import torch

from epd_engine.transfer import AVAILABLE_TRANSFER_BACKENDS, TRANSFER_BACKENDS
from epd_engine.transfer.auto import AutoBackend
from epd_engine.transfer.backend import Exports, TransferError
from epd_engine.transfer.factory import (
    TransferSettings,
    cache_memory,
    check_backend,
    make_backend,
    nccl_missing,
)
from tests.engine.transfer.peers import SPEC


def test_every_name_the_api_accepts_is_built_by_this_engine() -> None:
    assert set(AVAILABLE_TRANSFER_BACKENDS) == set(TRANSFER_BACKENDS)
    assert {"cuda_ipc", "nccl"} <= set(TRANSFER_BACKENDS)


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


async def test_auto_on_cpu_is_shm_near_and_tcp_far_and_forwards_control_far() -> None:
    memory = cache_memory("auto", "cpu")
    regions = SPEC.allocate(memory)
    async with httpx.AsyncClient() as http:
        backend = make_backend(TransferSettings(), memory, regions, Exports(), http, "t")
        try:
            assert isinstance(backend, AutoBackend)
            assert (backend.near.name, backend.far.name) == ("shm", "tcp")
            assert set(backend.describe()) == {"shm", "tcp"}
            with pytest.raises(TransferError, match="tcp backend has no control operation"):
                await backend.control("connect", {})
        finally:
            await backend.close()
