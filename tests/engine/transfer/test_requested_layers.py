"""What a source serves for a peer's transfer header: only pages the request exposes, and a
clear ``TransferError`` (answered to the peer) for a header that is not one."""

from __future__ import annotations

import pytest
import torch

from epd_engine.request import CacheKind
from epd_engine.transfer.backend import (
    CacheRegions,
    Exports,
    PageTransfer,
    TransferError,
    requested_layers,
)

REGIONS = CacheRegions(kv=[torch.zeros(4, 2, 2, 1, 1) for _ in range(3)])


def exports() -> Exports:
    ex = Exports()
    ex.expose("r1", CacheKind.KV, [1, 2])
    return ex


def test_a_header_from_page_transfer_resolves_to_its_layers_and_pages() -> None:
    header = PageTransfer("r1", CacheKind.KV, (2, 1), (0, 3), 1, 3).to_json()
    layers, pages = requested_layers(header, exports(), REGIONS)
    assert pages == [2, 1]
    assert [layer.data_ptr() for layer in layers] == [t.data_ptr() for t in REGIONS.kv[1:3]]


@pytest.mark.parametrize(
    "header",
    [
        {},
        {"request_id": "r1", "kind": "kv", "src_pages": [1], "layers": [0]},
        {"request_id": "r1", "kind": "weights", "src_pages": [1], "layers": [0, 1]},
        {"request_id": "r1", "kind": "kv", "src_pages": ["x"], "layers": [0, 1]},
        {"request_id": "r1", "kind": "kv", "src_pages": 7, "layers": [0, 1]},
    ],
)
def test_a_malformed_header_is_a_transfer_error(header: dict[str, object]) -> None:
    with pytest.raises(TransferError, match="malformed transfer header"):
        requested_layers(header, exports(), REGIONS)


def test_pages_the_request_does_not_expose_are_refused() -> None:
    header = PageTransfer("r1", CacheKind.KV, (3,), (0,), 0, 1).to_json()
    with pytest.raises(TransferError, match="outside what r1 exposes"):
        requested_layers(header, exports(), REGIONS)
