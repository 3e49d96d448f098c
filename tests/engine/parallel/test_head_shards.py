"""Moving KV pages between instances of different tensor-parallel sizes (issue 34, item 2's
building block): every head of every page lands where the other size keeps it."""

from __future__ import annotations

import pytest
import torch

from epd_engine.parallel.head_shards import HeadPiece, head_pieces, relay


def test_one_rank_to_two_splits_the_heads():
    assert head_pieces(4, 1, 2) == [HeadPiece(0, 0, 0, 0, 2), HeadPiece(0, 1, 2, 0, 2)]


def test_two_ranks_to_four_and_back():
    four = head_pieces(8, 2, 4)
    assert [(p.src_rank, p.dst_rank, p.src_start, p.count) for p in four] == [
        (0, 0, 0, 2), (0, 1, 2, 2), (1, 2, 0, 2), (1, 3, 2, 2)]  # fmt: skip
    back = head_pieces(8, 4, 2)
    assert [(p.src_rank, p.dst_rank, p.dst_start) for p in back] == [
        (0, 0, 0), (1, 0, 2), (2, 1, 0), (3, 1, 2)]  # fmt: skip


def test_sizes_that_do_not_divide_the_heads_are_refused():
    with pytest.raises(ValueError, match="do not split over 4 ranks"):
        head_pieces(2, 1, 4)


def _cut(whole: torch.Tensor, size: int) -> list[torch.Tensor]:
    return [piece.clone() for piece in whole.chunk(size, dim=3)]


@pytest.mark.parametrize(("src_size", "dst_size"), [(1, 2), (2, 1), (2, 4), (4, 2), (2, 2)])
def test_relayed_pages_equal_the_whole_cache_cut_the_other_way(src_size, dst_size):
    whole = torch.randn(6, 2, 4, 8, 3)  # [blocks, K/V, block size, heads, head dim]
    src = _cut(whole, src_size)
    dst = [torch.zeros_like(t) for t in _cut(whole, dst_size)]
    relay(src, [4, 1], dst, [0, 5])
    moved = torch.zeros_like(whole)
    moved[[0, 5]] = whole[[4, 1]]
    for got, want in zip(dst, _cut(moved, dst_size), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
