"""Which page copies a PullTask turns into (pure; no backend involved)."""

from __future__ import annotations

import pytest

from epd_engine.request import CacheKind, PullSpec
from epd_engine.scheduler.output import PullTask
from epd_engine.transfer.backend import TransferError
from epd_engine.transfer.plan import transfers_for


def kv_task(num_tokens: int, src: tuple[int, ...], dst: list[int]) -> PullTask:
    spec = PullSpec(CacheKind.KV, "http://p", "p-0", kv_pages=src)
    return PullTask("r", CacheKind.KV, spec, kv_blocks=dst, num_kv_tokens=num_tokens)


def test_kv_moves_in_layer_groups_over_the_pages_holding_computed_tokens() -> None:
    task = kv_task(40, (7, 8, 9), [0, 1, 2, 3])  # 40 tokens of 16: 3 pages; 4 allocated
    transfers = transfers_for(task, num_layers=10, layers_per_group=4, kv_block_size=16)
    assert [(t.layer_start, t.layer_stop) for t in transfers] == [(0, 4), (4, 8), (8, 10)]
    assert all(t.src_pages == (7, 8, 9) and t.dst_pages == (0, 1, 2) for t in transfers)


def test_kv_with_too_few_source_pages_is_an_error_not_a_short_copy() -> None:
    with pytest.raises(TransferError, match="need 3 KV pages"):
        transfers_for(kv_task(40, (7, 8), [0, 1, 2]), 2, 8, 16)


def test_images_cached_here_are_not_pulled() -> None:
    spec = PullSpec(CacheKind.IMAGE, "http://e", "e-0", image_pages=((4,), (5, 6), (7,)))
    task = PullTask("r", CacheKind.IMAGE, spec, image_blocks={0: [1], 2: [3]})
    (transfer,) = transfers_for(task, num_layers=4, layers_per_group=8, kv_block_size=16)
    assert transfer.src_pages == (4, 7) and transfer.dst_pages == (1, 3)
    assert (transfer.layer_start, transfer.layer_stop) == (0, 1)
    every_image_cached = PullTask("r", CacheKind.IMAGE, spec)
    assert transfers_for(every_image_cached, 4, 8, 16) == []


def test_image_page_counts_must_match() -> None:
    spec = PullSpec(CacheKind.IMAGE, "http://e", "e-0", image_pages=((4, 5),))
    task = PullTask("r", CacheKind.IMAGE, spec, image_blocks={0: [1]})
    with pytest.raises(TransferError, match="page sizes"):
        transfers_for(task, 4, 8, 16)


def test_sliding_layers_pull_only_the_pages_of_their_window() -> None:
    """Gemma 3's sliding layers read only their last ``window`` positions from now on: the
    pages behind that are not moved for them (global layers still move every page)."""
    task = kv_task(70, (10, 11, 12, 13, 14), [0, 1, 2, 3, 4])  # 70 tokens of 16: 5 pages
    windows = (20, 20, None, 20, 20, None)  # the next token (70) sees 51..70: pages 3, 4
    transfers = transfers_for(task, 6, 4, 16, windows)
    assert [(t.layer_start, t.layer_stop, t.src_pages, t.dst_pages) for t in transfers] == [
        (0, 2, (13, 14), (3, 4)),
        (2, 3, (10, 11, 12, 13, 14), (0, 1, 2, 3, 4)),
        (3, 4, (13, 14), (3, 4)),
        (4, 5, (13, 14), (3, 4)),  # a new layer group
        (5, 6, (10, 11, 12, 13, 14), (0, 1, 2, 3, 4)),
    ]
    moved = sum(len(t.src_pages) * (t.layer_stop - t.layer_start) for t in transfers)
    assert moved == 4 * 2 + 2 * 5  # page-layers: 18 of the 30 a window-blind pull moves
    untrimmed = transfers_for(task, 6, 4, 16)
    assert sum(len(t.src_pages) * (t.layer_stop - t.layer_start) for t in untrimmed) == 30


def test_a_window_longer_than_the_context_moves_every_page_and_held_pages_stay() -> None:
    task = kv_task(40, (7, 8, 9), [0, 1, 2])
    assert transfers_for(task, 2, 8, 16, (64, None)) == transfers_for(task, 2, 8, 16)
    held = PullTask("r", CacheKind.KV, task.source, kv_blocks=[0, 1, 2], num_kv_tokens=40,
                    num_held_kv_pages=2)  # fmt: skip
    (transfer,) = transfers_for(held, 2, 8, 16, (8, 8))  # window from token 33: page 2
    assert transfer.src_pages == (9,) and (transfer.layer_start, transfer.layer_stop) == (0, 2)
