"""Attention backend seam: the model calls a backend, never a kernel directly.

A step has two phases, as in vLLM's metadata builders and FlashInfer's plan/run:

- ``prepare`` runs **once per step**: it turns the batch (host lists) into device tensors
  in FlashInfer's int32 CSR form -- ``qo_indptr``, ``kv_indptr``, ``kv_indices``,
  ``kv_last_page_len`` -- plus the slot of every new token and the decode/prefill split.
- ``forward`` runs **once per layer** and only reads that metadata.

Tokens of one step are a flat, ragged batch: sequence ``i`` owns query rows
``qo_indptr[i]:qo_indptr[i + 1]``, decodes (one new token after a cached context) first.
Each layer's paged KV cache is one tensor ``[num_blocks, 2, block_size, num_kv_heads,
head_dim]`` (index 0 = K, 1 = V), the layout FlashInfer calls NHD.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from epd_engine.model.input_buffers import DecodeBuffers, DecodeFill


@dataclass(frozen=True)
class AttentionBatch:
    """One step's sequences as the scheduler sees them (host lists, no tensors)."""

    query_lens: list[int]  # [S] new tokens per sequence
    context_lens: list[int]  # [S] tokens in the cache per sequence *after* this step
    block_tables: list[list[int]]  # [S][>= pages needed]: pages of each sequence, in order
    block_size: int
    # [S][spans]: absolute ``[start, end)`` positions whose tokens all see each other (an
    # image's tokens in Gemma 3's prefill); None: causal only. A span must lie in one step.
    bidirectional: list[list[tuple[int, int]]] | None = None

    def __post_init__(self) -> None:
        for seq, (q_len, ctx) in enumerate(zip(self.query_lens, self.context_lens, strict=True)):
            if q_len > ctx:
                raise ValueError(f"sequence {seq}: {q_len} new tokens but context {ctx}")
            if -(-ctx // self.block_size) > len(self.block_tables[seq]):
                raise ValueError(f"sequence {seq}: block table too short for {ctx} tokens")

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_decodes(self) -> int:
        """Leading sequences that append one token to a cached context (the decode group)."""
        count = 0
        for q_len, ctx in zip(self.query_lens, self.context_lens, strict=True):
            if q_len != 1 or ctx <= 1:
                break
            count += 1
        return count


@dataclass
class AttentionMetadata:
    """Where one step's tokens sit in the paged KV cache; built once, read by every layer.

    Device tensors are int32 (FlashInfer's index type) except ``slot_mapping`` and
    ``positions``, int64 because torch indexing wants int64 and converting in every layer
    would undo the point. Host mirrors of the lengths drive loops that need Python ints.
    """

    block_size: int
    num_decodes: int  # sequences [0, num_decodes) are single-token decodes
    qo_indptr: torch.Tensor  # [S + 1] int32: query rows of sequence i
    kv_indptr: torch.Tensor  # [S + 1] int32: pages of sequence i in kv_indices
    kv_indices: torch.Tensor  # [sum pages] int32: every sequence's pages, in order
    kv_last_page_len: torch.Tensor  # [S] int32: tokens used in each sequence's last page
    context_lens: torch.Tensor  # [S] int32
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset of each new token
    positions: torch.Tensor  # [T] int64: absolute position of each new token
    query_lens_host: list[int]
    context_lens_host: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


def build_metadata(batch: AttentionBatch, device: torch.device) -> AttentionMetadata:
    """The backend-independent part of ``prepare``: one host-to-device copy, then tensor ops."""
    block_size = batch.block_size
    num_pages = [-(-ctx // block_size) for ctx in batch.context_lens]
    qo_indptr, kv_indptr = [0], [0]
    for q_len, pages in zip(batch.query_lens, num_pages, strict=True):
        qo_indptr.append(qo_indptr[-1] + q_len)
        kv_indptr.append(kv_indptr[-1] + pages)
    kv_indices: list[int] = []
    for table, pages in zip(batch.block_tables, num_pages, strict=True):
        kv_indices.extend(table[:pages])
    last_page_len = [
        ctx - (pages - 1) * block_size
        for ctx, pages in zip(batch.context_lens, num_pages, strict=True)
    ]
    num_seqs = batch.num_seqs
    # One packed copy: a host tensor per field would be one transfer (and sync) per field.
    packed = torch.tensor(
        qo_indptr + kv_indptr + last_page_len + batch.context_lens + kv_indices, dtype=torch.int32
    ).to(device, non_blocking=True)
    cut = [num_seqs + 1, num_seqs + 1, num_seqs, num_seqs, len(kv_indices)]
    qo_t, kv_t, last_t, ctx_t, indices_t = packed.split(cut)
    num_tokens = qo_indptr[-1]
    query_lens_t = qo_t[1:] - qo_t[:-1]  # [S]
    seq_of_token = torch.repeat_interleave(
        torch.arange(num_seqs, device=device), query_lens_t, output_size=num_tokens
    )  # [T]
    offset_in_seq = torch.arange(num_tokens, device=device) - qo_t[:-1].long()[seq_of_token]
    positions = (ctx_t - query_lens_t).long()[seq_of_token] + offset_in_seq  # [T]
    page_of_token = kv_t[:-1].long()[seq_of_token] + torch.div(
        positions, block_size, rounding_mode="floor"
    )
    slots = indices_t.long()[page_of_token] * block_size + positions % block_size  # [T]
    return AttentionMetadata(
        block_size=block_size,
        num_decodes=batch.num_decodes,
        qo_indptr=qo_t,
        kv_indptr=kv_t,
        kv_indices=indices_t,
        kv_last_page_len=last_t,
        context_lens=ctx_t,
        slot_mapping=slots,
        positions=positions,
        query_lens_host=list(batch.query_lens),
        context_lens_host=list(batch.context_lens),
    )


def buffer_metadata(buffers: DecodeBuffers, fill: DecodeFill) -> AttentionMetadata:
    """A filled decode step's metadata as views of the persistent buffers (no new tensors)."""
    rows = fill.rows
    return AttentionMetadata(
        block_size=buffers.block_size,
        num_decodes=rows,
        qo_indptr=buffers.qo_indptr[: rows + 1],
        kv_indptr=buffers.kv_indptr[: rows + 1],
        kv_indices=buffers.kv_indices[: fill.num_pages],
        kv_last_page_len=buffers.kv_last_page_len[:rows],
        context_lens=buffers.context_lens[:rows],
        slot_mapping=buffers.slot_mapping[:rows],
        positions=buffers.positions[:rows],
        query_lens_host=[1] * rows,
        context_lens_host=fill.context_lens,
    )


class AttentionBackend(Protocol):
    """Contract: ``prepare`` once per step, then ``forward`` in every layer.

    ``forward`` writes this step's K/V into the pages, then attends causally: query row
    ``j`` of sequence ``i`` sits at absolute position ``context_lens[i] - q_len_i + j`` and
    sees cache positions ``0..that position``; with a ``window`` only the last ``window`` of
    them (itself included: a sliding-window layer), and in either case every position of a
    bidirectional span it is in (``AttentionBatch.bidirectional``). Returns ``[T,
    num_heads, head_dim]``. Must not change ``q``, and must not build metadata (that is
    ``prepare``'s job).
    """

    def prepare(self, batch: AttentionBatch, device: torch.device) -> AttentionMetadata: ...

    def prepare_decode(self, buffers: DecodeBuffers, fill: DecodeFill) -> AttentionMetadata:
        """``prepare`` for a decode-only step already written into ``buffers`` (padded to
        ``fill.rows``): metadata as views of them, anything derived computed into them."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor: ...
