"""Build the configured backend and the cache memory it needs (shared for shm/auto on CPU).

On CPU caches ``auto`` is shm + tcp; on CUDA caches it is cuda_ipc with peers whose GPU
this process sees, else nixl (tcp without NIXL); ``nccl`` is asked for by name. ``cuda_ipc``
and ``nccl`` are refused with a clear error unless the caches are on a CUDA device (and,
for nccl, CuPy with NCCL imports), ``nixl`` unless NIXL imports: ``check_backend``.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import torch

from epd_engine.transfer import AVAILABLE_TRANSFER_BACKENDS, GPU_TRANSFER_BACKENDS
from epd_engine.transfer.auto import AutoBackend
from epd_engine.transfer.backend import CacheRegions, Exports, TransferBackend
from epd_engine.transfer.collective import CollectiveBackend, cache_device
from epd_engine.transfer.memory import CacheMemory, PrivateMemory, SharedMemory
from epd_engine.transfer.shm import ShmBackend
from epd_engine.transfer.tcp import TcpBackend


@dataclass(frozen=True)
class TransferSettings:
    backend: str = "auto"
    bind_host: str = "127.0.0.1"  # where the tcp page server listens
    advertise_host: str = "127.0.0.1"  # how peers reach it
    tcp_port: int = 0  # 0: any free port (it travels in each offer)
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.backend not in AVAILABLE_TRANSFER_BACKENDS:
            raise ValueError(
                f"transfer backend {self.backend!r} is not available in this build; "
                f"use one of {', '.join(AVAILABLE_TRANSFER_BACKENDS)}"
            )


def nccl_missing() -> str | None:
    """Why the nccl backend cannot run here (CuPy or its NCCL missing), or None."""
    from epd_engine.transfer.nccl import cupy_nccl

    try:
        cupy_nccl()
    except RuntimeError as exc:
        return str(exc)
    return None


def nixl_missing() -> str | None:
    """Why the nixl backend cannot run here (NIXL not installed), or None."""
    from epd_engine.transfer.nixl_agent import nixl_missing as missing

    return missing()


def check_backend(backend: str, device: str) -> None:
    """``ValueError`` saying why ``backend`` cannot move caches on ``device``."""
    on_cuda = torch.device(device).type == "cuda"
    if backend == "nixl" and (why := nixl_missing()) is not None:
        raise ValueError(why)
    if backend == "shm" and on_cuda:
        raise ValueError(
            "the shm backend moves CPU caches; on GPUs use auto, cuda_ipc, nixl or nccl"
        )
    if backend not in GPU_TRANSFER_BACKENDS:
        return
    if not on_cuda:
        raise ValueError(
            f"the {backend} backend moves CUDA caches and the device is {device}; "
            "on CPU use auto, shm, tcp, nixl or collective"
        )
    if not torch.cuda.is_available():
        raise ValueError(f"the {backend} backend needs a CUDA device; none is visible")
    if backend == "nccl" and (why := nccl_missing()) is not None:
        raise ValueError(why)


def uses_shared_memory(backend: str, device: str) -> bool:
    return backend in ("shm", "auto") and torch.device(device).type == "cpu"


def cache_memory(backend: str, device: str) -> CacheMemory:
    """Where caches go: memfd regions when a same-host peer may map them, else private."""
    check_backend(backend, device)
    if uses_shared_memory(backend, device):
        return SharedMemory()
    return PrivateMemory(torch.device(device))


def make_backend(
    settings: TransferSettings,
    memory: CacheMemory,
    regions: CacheRegions,
    exports: Exports,
    http: httpx.AsyncClient,
    token: str,
) -> TransferBackend:
    def tcp() -> TcpBackend:
        return TcpBackend(regions, exports, token, settings.bind_host, settings.advertise_host,
                          settings.tcp_port, settings.timeout_s)  # fmt: skip

    def collective(communicator: str) -> CollectiveBackend:
        return CollectiveBackend(regions, exports, http, token, settings.bind_host,
                                 settings.advertise_host, settings.timeout_s,
                                 communicator)  # fmt: skip

    def nixl() -> TransferBackend:
        from epd_engine.transfer.nixl import NixlBackend

        return NixlBackend(regions, settings.timeout_s)

    name = settings.backend
    on_cuda = cache_device(regions).type == "cuda"
    check_backend(name, str(cache_device(regions)))
    if name in ("cuda_ipc", "auto") and on_cuda:
        from epd_engine.transfer.cuda_ipc import CudaIpcBackend

        near = CudaIpcBackend(regions, token)
        if name == "cuda_ipc":
            return near
        return AutoBackend(near, tcp() if nixl_missing() else nixl())
    if name == "nixl":
        return nixl()
    if name == "nccl":
        return collective("nccl")
    if name == "collective":
        return collective("gloo")
    if name == "tcp" or (name == "auto" and not isinstance(memory, SharedMemory)):
        return tcp()
    assert isinstance(memory, SharedMemory)
    shm = ShmBackend(memory, regions, token)
    return shm if name == "shm" else AutoBackend(shm, tcp())
