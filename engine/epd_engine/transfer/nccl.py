"""The ``Communicator`` on NCCL through CuPy: a two-rank group per peer pair, on GPUs.

Formed like the gloo pair (``communicator.form_pair``): the store's host makes NCCL's unique
id (``nccl.get_unique_id()``: bytes, or a tuple of ints before CuPy 14) and shares it
through the rendezvous store as JSON; both ranks then create
``NcclCommunicator(2, unique_id, rank)`` on the caches' GPU.
``send``/``recv`` move a tensor's bytes (``NCCL_UINT8``) on the pair's own stream and wait
for its event in the calling thread, polling so that a timeout, a ``close`` or an NCCL
error (a peer that aborted) ends the wait; the group is then aborted. CPU tensors (the
protocol's small headers) are staged through the GPU. Tags are not needed: NCCL matches
sends and receives in order per pair, and the collective backend keeps that order.

NCCL refuses two ranks of one group on one GPU ("Duplicate GPU"): same-GPU peers use
``cuda_ipc``. Not verified on a GPU: the one-GPU machine it ran on refused two ranks on
its GPU at NCCL's init (docs/gpu.md).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from epd_engine.transfer.communicator import share_unique_id

POLL_S = (0.00002, 0.001)  # first and longest sleep between event queries


def cupy_nccl() -> Any:
    """CuPy's NCCL module; ``RuntimeError`` saying what is missing."""
    try:
        from cupy.cuda import nccl  # type: ignore[import-not-found,unused-ignore]
    except ImportError as exc:
        raise RuntimeError(f"the nccl backend needs CuPy with NCCL (cupy-cuda13x): {exc}") from exc
    if not getattr(nccl, "available", True):
        raise RuntimeError("CuPy was built without NCCL")
    return nccl


def unique_id_forms(values: tuple[int, ...]) -> list[bytes | tuple[int, ...]]:
    """The id as each CuPy takes it: bytes (CuPy 14, seen on an H200 machine) or a tuple of C
    chars (earlier CuPy, signed: -128..127)."""
    return [bytes(v & 0xFF for v in values), tuple(values)]


def communicator(nccl: Any, values: tuple[int, ...], rank: int) -> Any:
    """``NcclCommunicator(2, id, rank)`` with the id in this CuPy's form (a wrong form is a
    TypeError before NCCL is called, so trying the next one is safe)."""
    for form in unique_id_forms(values):
        try:
            return nccl.NcclCommunicator(2, form, rank)
        except TypeError as exc:
            error = exc
    raise RuntimeError(f"CuPy's NcclCommunicator takes neither id form: {error}")


class NcclPair:
    def __init__(self, store: dist.Store, key: str, rank: int, device: torch.device) -> None:
        nccl = cupy_nccl()  # first: a clear RuntimeError without CuPy
        import cupy  # type: ignore[import-not-found,unused-ignore]

        if device.type != "cuda":
            raise RuntimeError("the nccl communicator needs the caches on a CUDA device")
        self.rank = rank
        self.device = torch.device("cuda", device.index or 0)
        self._nccl = nccl
        self._cupy_device = cupy.cuda.Device(self.device.index)
        unique_id = share_unique_id(store, key, rank, nccl.get_unique_id)
        with self._cupy_device:
            self._comm = communicator(nccl, unique_id, rank)
        self._stream = torch.cuda.Stream(self.device)
        self._closed = threading.Event()

    def send(self, tensor: torch.Tensor, tag: int, timeout_s: float | None = None) -> None:
        staged = tensor if tensor.device == self.device else tensor.to(self.device)
        self._run(staged, True, timeout_s)

    def recv(self, tensor: torch.Tensor, tag: int, timeout_s: float | None = None) -> None:
        staged = tensor
        if tensor.device != self.device:
            staged = torch.empty_like(tensor, device=self.device)
        self._run(staged, False, timeout_s)
        if staged is not tensor:
            tensor.copy_(staged)

    def _run(self, tensor: torch.Tensor, send: bool, timeout_s: float | None) -> None:
        if not tensor.is_contiguous():
            raise RuntimeError("NCCL moves contiguous tensors only")
        if self._closed.is_set():
            raise RuntimeError("the NCCL group is closed")
        count = tensor.numel() * tensor.element_size()
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the bytes were written there
        with self._cupy_device:
            op = self._comm.send if send else self._comm.recv
            op(tensor.data_ptr(), count, self._nccl.NCCL_UINT8, 1 - self.rank, stream.cuda_stream)
        done = torch.cuda.Event()
        done.record(stream)
        self._wait(done, timeout_s)
        if not send:
            torch.cuda.current_stream(self.device).wait_stream(stream)

    def _wait(self, done: torch.cuda.Event, timeout_s: float | None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        sleep = POLL_S[0]
        while not done.query():
            if self._closed.is_set():
                raise RuntimeError("the NCCL group was closed during a transfer")
            try:
                self._comm.check_async_error()
            except Exception as exc:  # CuPy's NcclError: the peer aborted or vanished
                self.close()
                raise RuntimeError(f"NCCL error: {exc}") from exc
            if deadline is not None and time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"NCCL transfer timed out after {timeout_s:.0f}s")
            time.sleep(sleep)
            sleep = min(sleep * 2, POLL_S[1])

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        with contextlib.suppress(Exception):  # already broken: nothing left to tear down
            self._comm.abort()
