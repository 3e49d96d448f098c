"""Which KV heads of which rank go where when a cache moves between instances of different
tensor-parallel sizes (issue 34, item 2: the building block; migration does not use it yet).

Rank r of an instance of size N holds KV heads ``[r H/N, (r+1) H/N)`` of every page, at
head offsets ``0 .. H/N`` of its own tensors. Moving a page from size N to size M copies,
for every pair of ranks whose head ranges overlap, the overlap: ``max(N, M)`` pieces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HeadPiece:
    """KV heads ``[src_start, src_start + count)`` of source rank ``src_rank``'s tensors go
    to heads ``[dst_start, ...)`` of destination rank ``dst_rank``'s."""

    src_rank: int
    dst_rank: int
    src_start: int
    dst_start: int
    count: int


def head_pieces(num_kv_heads: int, src_size: int, dst_size: int) -> list[HeadPiece]:
    """The pieces of a page from ``src_size`` ranks to ``dst_size`` ranks, in head order."""
    for size in (src_size, dst_size):
        if size < 1 or num_kv_heads % size:
            raise ValueError(f"{num_kv_heads} KV heads do not split over {size} ranks")
    src_per, dst_per = num_kv_heads // src_size, num_kv_heads // dst_size
    pieces = []
    head = 0
    while head < num_kv_heads:
        src_rank, dst_rank = head // src_per, head // dst_per
        end = min((src_rank + 1) * src_per, (dst_rank + 1) * dst_per)
        pieces.append(HeadPiece(src_rank, dst_rank, head - src_rank * src_per,
                                head - dst_rank * dst_per, end - head))  # fmt: skip
        head = end
    return pieces


def relay(
    src: Sequence[torch.Tensor],  # per source rank: one layer [blocks, 2, bs, H/N, D]
    src_pages: Sequence[int],
    dst: Sequence[torch.Tensor],  # per destination rank: one layer [blocks, 2, bs, H/M, D]
    dst_pages: Sequence[int],
) -> None:
    """Copy ``src_pages`` of one layer, cut over ``len(src)`` ranks, into ``dst_pages`` of
    the same layer cut over ``len(dst)`` ranks (tensors any rank's process can address)."""
    num_heads = src[0].shape[3] * len(src)
    src_index = torch.tensor(list(src_pages), device=src[0].device)
    dst_index = torch.tensor(list(dst_pages), device=dst[0].device)
    for p in head_pieces(num_heads, len(src), len(dst)):
        pages = src[p.src_rank].index_select(0, src_index)
        heads = pages[:, :, :, p.src_start : p.src_start + p.count]
        target = dst[p.dst_rank]
        view = target[:, :, :, p.dst_start : p.dst_start + p.count]
        view.index_copy_(0, dst_index.to(target.device), heads.to(target.device))
