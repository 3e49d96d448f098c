"""Where the cache tensors live: private memory, or memory other processes can map.

The ``shm`` backend needs the KV and image caches in shared memory so a peer on the same
host can copy pages straight out of them. Each region is an anonymous ``memfd``: it has
no name in ``/dev/shm``, peers receive its file descriptor over a Unix socket, and the
kernel frees it when the last process holding it exits -- a killed instance leaks nothing.
"""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass, field
from typing import Protocol

import torch


class CacheMemory(Protocol):
    def zeros(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed tensor for the cache region ``name`` (unique per instance)."""
        ...


@dataclass
class PrivateMemory:
    device: torch.device

    def zeros(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)


@dataclass(frozen=True)
class SharedRegion:
    """One shareable cache tensor: peers map ``fd`` and view it with ``shape``/``dtype``."""

    name: str
    fd: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    tensor: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def header(self) -> dict[str, object]:
        """What a peer needs besides the fd (plain JSON)."""
        return {"name": self.name, "shape": list(self.shape), "dtype": dtype_name(self.dtype)}


@dataclass
class SharedMemory:
    """CPU caches in memfd regions (fresh pages are already zero)."""

    regions: dict[str, SharedRegion] = field(default_factory=dict)

    def zeros(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if name in self.regions:
            raise ValueError(f"cache region {name!r} allocated twice")
        nbytes = max(1, math.prod(shape) * torch.empty((), dtype=dtype).element_size())
        fd = os.memfd_create(f"epd-{name}", os.MFD_CLOEXEC)
        os.ftruncate(fd, nbytes)
        tensor = map_region(fd, nbytes, shape, dtype)
        self.regions[name] = SharedRegion(name, fd, shape, dtype, tensor)
        return tensor


def map_region(fd: int, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor over the whole of a shared region (the mapping lives as long as the tensor)."""
    buffer = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(buffer, dtype=dtype, count=math.prod(shape)).view(shape)


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported cache dtype {name!r}") from None
