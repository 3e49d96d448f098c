"""Attention backend seam: the model calls a backend, never a kernel directly.

Tokens of one iteration are a flat, ragged batch: sequence ``i`` owns query rows
``query_start_loc[i]:query_start_loc[i + 1]``. Each layer's paged KV cache is one tensor
``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` (index 0 = K, 1 = V), the layout
FlashInfer calls NHD, so a FlashInfer backend can plug in without touching the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Where one iteration's tokens sit in the paged KV cache."""

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset for each new token
    query_start_loc: list[int]  # [S + 1]: prefix sums of new tokens per sequence
    context_lens: list[int]  # [S]: tokens in the cache per sequence *after* this step
    block_tables: list[list[int]]  # [S][num_blocks_i]: pages of each sequence, in order
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


class AttentionBackend(Protocol):
    """Contract: write this step's K/V into the pages, then attend causally.

    Query row ``j`` of sequence ``i`` sits at absolute position
    ``context_lens[i] - q_len_i + j`` and sees cache positions ``0..that position``.
    Returns ``[T, num_heads, head_dim]``. Must not change ``q``.
    """

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...
