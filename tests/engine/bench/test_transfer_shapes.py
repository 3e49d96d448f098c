"""The shapes bench-transfer moves: real geometry, the engine's layer groups."""

from __future__ import annotations

from epd_engine.bench.transfer_shapes import llava_7b_shape, tiny_shape
from epd_engine.request import CacheKind


def test_the_7b_request_is_335_mb_of_kv_in_four_groups_and_a_4_7_mb_image() -> None:
    shape = llava_7b_shape()
    kv = shape.kv_transfers()
    assert shape.num_kv_pages == 40  # 640 tokens / 16
    assert [(t.layer_start, t.layer_stop) for t in kv] == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert all(t.src_pages == tuple(range(40)) for t in kv)
    assert sum(shape.nbytes(t) for t in kv) == 640 * 2 * 32 * 32 * 128 * 2 == 335_544_320
    [image] = shape.image_transfers()
    assert image.kind is CacheKind.IMAGE and shape.nbytes(image) == 576 * 4096 * 2
    [page] = shape.page_transfers()
    assert shape.nbytes(page) == 2 * 16 * 32 * 128 * 2  # one page of one layer


def test_the_tiny_shape_follows_the_checkpoint_or_the_preset() -> None:
    shape = tiny_shape(None, num_tokens=20, layers_per_group=8)
    assert shape.spec.num_layers == 2 and shape.spec.dtype == "float32"
    assert len(shape.kv_transfers()) == 1  # two layers: one group
    assert shape.num_kv_pages == 2  # 20 tokens in pages of 16
    assert shape.nbytes(shape.image_transfers()[0]) == 16 * 64 * 4
