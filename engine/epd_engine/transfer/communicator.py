"""Point-to-point communicators: gloo on CPU, NCCL (CuPy, ``transfer/nccl.py``) on GPUs.

A ``Communicator`` is a group of exactly two ranks formed once per peer pair through a
rendezvous store (the target hosts a ``TCPStore``; the source joins it), then carries
blocking ``send``/``recv`` of contiguous tensors matched by tag. ``form_pair`` picks the
implementation by name. NCCL has no tags: there they become per-pair ordering, which the
collective backend keeps (one transfer at a time per group). NCCL's unique id travels
through the same store as JSON (``share_unique_id``), never pickle.
"""

from __future__ import annotations

import contextlib
import datetime
import json
from collections.abc import Callable, Sequence
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


COMMUNICATORS = ("gloo", "nccl")
STORE_HOST_RANK = 1  # the target hosts the rendezvous store
MAX_UNIQUE_ID_INTS = 1024  # NCCL's unique id is 128 bytes


def unique_id_key(key: str) -> str:
    return f"{key}/unique_id"


def share_unique_id(
    store: dist.Store, key: str, rank: int, make_id: Callable[[], Sequence[int]]
) -> tuple[int, ...]:
    """The store's host makes the group's unique id and publishes it as a JSON list of ints;
    the other rank waits for it (the store's timeout) and checks it is one."""
    if rank == STORE_HOST_RANK:
        unique_id = tuple(int(x) for x in make_id())
        store.set(unique_id_key(key), json.dumps(list(unique_id)))
        return unique_id
    raw = store.get(unique_id_key(key))
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise RuntimeError(f"the group's unique id is not JSON: {raw[:40]!r}") from exc
    if (
        not isinstance(value, list)
        or not 0 < len(value) <= MAX_UNIQUE_ID_INTS
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in value)
    ):
        raise RuntimeError("the group's unique id is not a list of integers")
    return tuple(value)


def form_pair(
    kind: str,
    store: dist.Store,
    key: str,
    rank: int,
    host: str,
    device: torch.device,
    timeout_s: float,
) -> Communicator:
    """Join the two-rank group ``key`` as ``rank`` (both ranks call this concurrently)."""
    if kind == "gloo":
        return GlooPair(store, key, rank, host, timeout_s)
    if kind == "nccl":
        from epd_engine.transfer.nccl import NcclPair

        return NcclPair(store, key, rank, device)
    raise ValueError(f"unknown communicator {kind!r}; known: {', '.join(COMMUNICATORS)}")


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
