"""Page runs and direct page copies: the arithmetic every backend relies on."""

from __future__ import annotations

import pytest
import torch

from epd_engine.transfer.pages import byte_view, copy_pages, page_runs, paired_runs


def test_page_runs_merge_consecutive_ids_in_order() -> None:
    assert page_runs([3, 4, 5, 9, 1, 2]) == [(3, 6), (9, 10), (1, 3)]
    assert page_runs([]) == []


def test_paired_runs_split_where_either_side_breaks() -> None:
    assert paired_runs([0, 1, 2, 3], [5, 6, 9, 10]) == [(0, 5, 2), (2, 9, 2)]
    with pytest.raises(ValueError):
        paired_runs([0, 1], [0])


def test_copy_pages_moves_exactly_the_named_pages_of_every_layer() -> None:
    src = [torch.randn(8, 2, 4) for _ in range(3)]
    dst = [torch.zeros(8, 2, 4) for _ in range(3)]
    moved = copy_pages(src, [1, 2, 6], dst, [5, 6, 0])
    assert moved == 3 * 3 * 2 * 4 * 4
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[[5, 6, 0]], s[[1, 2, 6]])
        assert not d[[1, 2, 3, 4, 7]].any()  # nothing else written


def test_byte_view_writes_land_in_the_tensor() -> None:
    layer = torch.zeros(4, 3, dtype=torch.float16)
    view = byte_view(layer, 1, 3)
    assert len(view) == 2 * 3 * 2
    view[:] = torch.ones(2, 3, dtype=torch.float16).view(torch.uint8).numpy().tobytes()
    assert layer[1:3].eq(1).all() and not layer[0].any() and not layer[3].any()
