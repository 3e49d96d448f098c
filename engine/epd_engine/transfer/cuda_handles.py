"""CUDA IPC handles of cache tensors as plain JSON (base64 bytes and ints), never pickle.

A source exports a tensor's storage with ``UntypedStorage._share_cuda_()`` -- what
``torch.multiprocessing.reductions.reduce_tensor`` does -- which yields the allocation's
IPC handle, the storage's size and offset in it, a cross-process reference counter (the
source's caching allocator keeps the block until every peer released it) and an event the
opener waits on. A peer opens it with ``UntypedStorage._new_shared_cuda(*those)`` and views
it with the tensor's shape, stride and offset. Only the two torch calls need a GPU; the
round trip through JSON and its validation are plain data.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

import torch

from epd_engine.transfer.backend import TransferError

MAX_HANDLE_BYTES = 4096  # a cudaIpcMemHandle is 64 bytes; a shm name for the ref counter less


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def _unb64(value: object, field: str, optional: bool = False) -> bytes | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > 2 * MAX_HANDLE_BYTES:
        raise TransferError(f"IPC handle field {field!r} must be a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise TransferError(f"IPC handle field {field!r} is not base64: {exc}") from None


def _int(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TransferError(f"IPC handle field {field!r} must be a non-negative integer")
    return value


@dataclass(frozen=True)
class IpcHandle:
    """One exported storage: the eight values ``_share_cuda_`` returns, in its order."""

    device: int
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool

    @classmethod
    def of_share(cls, shared: tuple[Any, ...]) -> IpcHandle:
        """From ``storage._share_cuda_()``'s tuple."""
        if len(shared) != 8:
            raise TransferError(f"_share_cuda_ returned {len(shared)} values, expected 8")
        device, handle, size, offset, rc_handle, rc_offset, event, sync = shared
        if not isinstance(handle, bytes) or not isinstance(rc_handle, bytes):
            raise TransferError("the storage has no IPC handle (empty or not shareable)")
        return cls(int(device), handle, int(size), int(offset), rc_handle, int(rc_offset),
                   event if isinstance(event, bytes) else None, bool(sync))  # fmt: skip

    def share_args(self) -> tuple[Any, ...]:
        """The arguments of ``UntypedStorage._new_shared_cuda``, with our device index."""
        return (self.device, self.handle, self.size_bytes, self.offset_bytes,
                self.ref_counter_handle, self.ref_counter_offset, self.event_handle,
                self.event_sync_required)  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "handle": _b64(self.handle),
            "size_bytes": self.size_bytes,
            "offset_bytes": self.offset_bytes,
            "ref_counter_handle": _b64(self.ref_counter_handle),
            "ref_counter_offset": self.ref_counter_offset,
            "event_handle": _b64(self.event_handle),
            "event_sync_required": self.event_sync_required,
        }

    @classmethod
    def from_json(cls, data: object) -> IpcHandle:
        """Validated; ``TransferError`` naming the first bad field."""
        if not isinstance(data, dict):
            raise TransferError("an IPC handle must be a JSON object")
        try:
            sync = data["event_sync_required"]
            if not isinstance(sync, bool):
                raise TransferError("IPC handle field 'event_sync_required' must be a boolean")
            handle = _unb64(data["handle"], "handle")
            rc_handle = _unb64(data["ref_counter_handle"], "ref_counter_handle")
            assert handle is not None and rc_handle is not None
            return cls(
                device=_int(data["device"], "device"),
                handle=handle,
                size_bytes=_int(data["size_bytes"], "size_bytes"),
                offset_bytes=_int(data["offset_bytes"], "offset_bytes"),
                ref_counter_handle=rc_handle,
                ref_counter_offset=_int(data["ref_counter_offset"], "ref_counter_offset"),
                event_handle=_unb64(data["event_handle"], "event_handle", optional=True),
                event_sync_required=sync,
            )
        except KeyError as exc:
            raise TransferError(f"IPC handle without field {exc}") from None


def export_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    """A contiguous CUDA tensor's handle and where it sits in its storage (JSON)."""
    if tensor.device.type != "cuda" or not tensor.is_contiguous():
        raise TransferError("only contiguous CUDA tensors can be exported over CUDA IPC")
    shared = tensor.untyped_storage()._share_cuda_()
    return {"ipc": IpcHandle.of_share(shared).to_json(), "storage_offset": tensor.storage_offset()}


def view_fits(handle: IpcHandle, shape: tuple[int, ...], dtype: torch.dtype, offset: int) -> None:
    """``TransferError`` unless a contiguous ``shape`` at ``offset`` lies inside the storage."""
    numel = 1
    for size in shape:
        numel *= size
    itemsize = torch.empty((), dtype=dtype).element_size()
    if (offset + numel) * itemsize > handle.size_bytes:
        raise TransferError(
            f"a {list(shape)} {dtype} view at {offset} overruns the {handle.size_bytes}-byte "
            "storage the peer exported"
        )


def open_tensor(
    extra: dict[str, Any], shape: tuple[int, ...], dtype: torch.dtype, device: int
) -> torch.Tensor:
    """Open a peer's exported tensor (``export_tensor``'s JSON) on our CUDA ``device``."""
    handle = IpcHandle.from_json(extra.get("ipc"))
    offset = _int(extra.get("storage_offset"), "storage_offset")
    view_fits(handle, shape, dtype, offset)
    args = (device, *handle.share_args()[1:])
    storage = torch.UntypedStorage._new_shared_cuda(*args)
    out = torch.empty(0, dtype=dtype, device=torch.device("cuda", device))
    return out.set_(storage, offset, shape, contiguous_strides(shape))


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides: list[int] = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
