"""CUDA IPC handles travel as JSON (base64 bytes, ints): the round trip is exact, and a
malformed handle is a clear ``TransferError``, never a crash in torch's C++ or a pickle."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from epd_engine.transfer.backend import TransferError
from epd_engine.transfer.cuda_handles import (
    IpcHandle,
    contiguous_strides,
    export_tensor,
    open_tensor,
    view_fits,
)

# What ``UntypedStorage._share_cuda_()`` returns, in its order (values as torch gives them).
SHARED = (0, bytes(range(64)), 4096, 512, b"/torch_123_456_0", 17, bytes(64), True)


def handle() -> IpcHandle:
    return IpcHandle.of_share(SHARED)


def test_a_handle_survives_json_exactly() -> None:
    text = json.dumps(handle().to_json())
    back = IpcHandle.from_json(json.loads(text))
    assert back == handle()
    assert back.share_args() == SHARED


def test_an_event_less_handle_round_trips() -> None:
    h = IpcHandle.of_share((*SHARED[:6], None, False))
    assert IpcHandle.from_json(json.loads(json.dumps(h.to_json()))).event_handle is None


def test_an_empty_storage_cannot_be_exported() -> None:
    with pytest.raises(TransferError, match="no IPC handle"):
        IpcHandle.of_share((0, None, 0, 0, None, 0, None, False))
    with pytest.raises(TransferError, match="expected 8"):
        IpcHandle.of_share(SHARED[:7])


def broken(**change: Any) -> dict[str, Any]:
    data = handle().to_json()
    for key, value in change.items():
        if value is ...:
            del data[key]
        else:
            data[key] = value
    return data


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "JSON object"),
        (broken(handle=...), "without field 'handle'"),
        (broken(handle="not base64!"), "'handle' is not base64"),
        (broken(handle=123), "'handle' must be a base64 string"),
        (broken(handle=None), "'handle' must be a base64 string"),
        (broken(device=-1), "'device' must be a non-negative integer"),
        (broken(size_bytes="4096"), "'size_bytes' must be a non-negative integer"),
        (broken(offset_bytes=True), "'offset_bytes' must be a non-negative integer"),
        (broken(ref_counter_offset=1.5), "'ref_counter_offset'"),
        (broken(event_sync_required="yes"), "'event_sync_required' must be a boolean"),
        (broken(ref_counter_handle="A" * 10000), "'ref_counter_handle' must be"),
    ],
)
def test_a_malformed_handle_is_a_transfer_error(data: object, message: str) -> None:
    with pytest.raises(TransferError, match=message):
        IpcHandle.from_json(data)


def test_a_view_must_lie_inside_the_exported_storage() -> None:
    h = handle()  # 4096 bytes
    view_fits(h, (2, 4, 128), torch.float32, 0)  # exactly 4096
    with pytest.raises(TransferError, match="overruns"):
        view_fits(h, (2, 4, 128), torch.float32, 1)
    with pytest.raises(TransferError, match="overruns"):
        open_tensor({"ipc": h.to_json(), "storage_offset": 0}, (4097,), torch.uint8, 0)
    with pytest.raises(TransferError, match="storage_offset"):
        open_tensor({"ipc": h.to_json(), "storage_offset": -1}, (1,), torch.uint8, 0)


def test_only_cuda_tensors_are_exported() -> None:
    with pytest.raises(TransferError, match="contiguous CUDA tensors"):
        export_tensor(torch.zeros(4))


def test_contiguous_strides_match_torch() -> None:
    for shape in [(3,), (4, 2, 16, 2, 8), (1, 5, 1), (0, 3)]:
        assert contiguous_strides(shape) == torch.empty(shape).stride(), shape
