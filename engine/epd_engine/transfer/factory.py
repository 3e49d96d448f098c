"""Build the configured backend and the cache memory it needs (shared for shm/auto on CPU)."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import torch

from epd_engine.transfer import AVAILABLE_TRANSFER_BACKENDS
from epd_engine.transfer.auto import AutoBackend
from epd_engine.transfer.backend import CacheRegions, Exports, TransferBackend
from epd_engine.transfer.collective import CollectiveBackend
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


def uses_shared_memory(backend: str, device: str) -> bool:
    return backend in ("shm", "auto") and torch.device(device).type == "cpu"


def cache_memory(backend: str, device: str) -> CacheMemory:
    """Where caches go: memfd regions when a same-host peer may map them, else private."""
    if backend == "shm" and torch.device(device).type != "cpu":
        raise ValueError("the shm backend moves CPU caches; on GPUs use auto or tcp")
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

    if settings.backend == "tcp" or (
        settings.backend == "auto" and not isinstance(memory, SharedMemory)
    ):
        return tcp()
    if settings.backend == "collective":
        return CollectiveBackend(regions, exports, http, token, settings.bind_host,
                                 settings.advertise_host, settings.timeout_s)  # fmt: skip
    assert isinstance(memory, SharedMemory)
    shm = ShmBackend(memory, regions, token)
    return shm if settings.backend == "shm" else AutoBackend(shm, tcp())
