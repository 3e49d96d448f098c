"""Point-to-point communicators: the shape NCCL needs, implemented on gloo for CPU.

A ``Communicator`` is a group of exactly two ranks formed once per peer pair through a
rendezvous store (the target hosts a ``TCPStore``; the source joins it), then carries
blocking ``send``/``recv`` of contiguous tensors matched by tag. The CuPy NCCL
implementation (a later, GPU-only piece) plugs in behind the same three methods; tags
there become per-pair ordering, which the collective backend already keeps.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any, Protocol

import torch
import torch.distributed as dist


class Communicator(Protocol):
    rank: int  # 0: the source (sends), 1: the target (receives)

    def send(self, tensor: torch.Tensor, tag: int, timeout_s: float | None = None) -> None:
        """Blocks until ``tensor`` (contiguous) is handed to the peer; sends with one tag
        are received in order. ``RuntimeError`` when the peer is gone or the time is up."""
        ...

    def recv(self, tensor: torch.Tensor, tag: int, timeout_s: float | None = None) -> None:
        """Blocks until ``tensor`` (contiguous, preallocated: a view of the destination
        pages works) holds the peer's send; ``None`` waits as long as the group allows."""
        ...

    def close(self) -> None: ...


def rendezvous_store(host: str, port: int, is_host: bool, timeout_s: float) -> dist.TCPStore:
    """The target hosts (``port`` 0 picks one); the source joins at the target's address."""
    return dist.TCPStore(
        host,
        port,
        world_size=2,
        is_master=is_host,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


class GlooPair:
    """Two ranks of a gloo process group, on the address the rendezvous used."""

    def __init__(self, store: dist.Store, key: str, rank: int, host: str, timeout_s: float) -> None:
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        options._timeout = datetime.timedelta(seconds=timeout_s)
        self.rank = rank
        self._group: Any = dist.ProcessGroupGloo(  # send/recv are untyped in torch's stubs
            dist.PrefixStore(f"{key}/", store), rank, 2, options
        )

    def send(self, tensor: torch.Tensor, tag: int, timeout_s: float | None = None) -> None:
        _wait(self._group.send([tensor], 1 - self.rank, tag), timeout_s)

    def recv(self, tensor: torch.Tensor, tag: int, timeout_s: float | None = None) -> None:
        _wait(self._group.recv([tensor], 1 - self.rank, tag), timeout_s)

    def close(self) -> None:
        with contextlib.suppress(RuntimeError):  # already broken: nothing left to tear down
            self._group.abort()


def _wait(work: Any, timeout_s: float | None) -> None:
    if timeout_s is None:
        work.wait()
    else:
        work.wait(datetime.timedelta(seconds=timeout_s))
