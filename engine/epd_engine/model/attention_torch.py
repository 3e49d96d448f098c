"""Reference paged attention in plain torch: the CPU path and the yardstick for GPU kernels.

``prepare`` (once per step) adds what the torch math needs to the shared metadata: the
decode group's padded page table and length mask, and per prefill its pages and causal
mask. ``forward`` (every layer) then only indexes and calls SDPA, one call per group so CPU
time goes to math, not Python:
- decodes (one new token each) are batched: their K and V rows are gathered with one
  ``index_select`` each from the cache seen as flat rows ``[num_blocks * 2 * block_size, Hkv,
  D]`` (row numbers built in ``prepare``) into a padded ``[S, L]`` K/V with a length mask;
- a prefill with nothing cached attends over its own K/V with ``is_causal`` (SDPA's fast
  path; an explicit mask would send it down the slow general path);
- a chunk after cached tokens gathers its pages and uses a causal mask offset by them.

A sliding-window layer (``forward(..., window=w)``) masks out keys more than ``w - 1``
positions back, and a bidirectional span (``AttentionBatch.bidirectional``) lets its tokens
see each other; both only change masks, built once per step and window.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from epd_engine.model.attention import (
    AttentionBatch,
    AttentionMetadata,
    buffer_metadata,
    build_metadata,
)
from epd_engine.model.input_buffers import DecodeBuffers, DecodeFill


@dataclass(frozen=True)
class PrefillPlan:
    """One prefill sequence: its query rows and, if it follows cached tokens, what to read."""

    start: int
    end: int
    context_len: int
    pages: torch.Tensor | None  # [n] int64; None: nothing cached, attend over own K/V
    # [q_len, context_len] bool: causal, offset by the cache, or-ed with the spans;
    # None: plain causal over its own K/V (SDPA's is_causal)
    mask: torch.Tensor | None
    span_mask: torch.Tensor | None = None  # [q_len, context_len] bool: pairs in one span
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # made on first use

    def mask_for(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """The mask of a layer seeing ``window`` positions back (None: all of them)."""
        q_len = self.end - self.start
        if window is None or window >= self.context_len:
            return self.mask
        if window not in self.window_masks:
            q_pos, k_pos = _positions(self.context_len, q_len, device)
            distance = q_pos[:, None] - k_pos[None, :]
            mask = (distance >= 0) & (distance < window)
            if self.span_mask is not None:
                mask |= self.span_mask
            self.window_masks[window] = mask
        return self.window_masks[window]


def _positions(
    context_len: int, q_len: int, device: torch.device | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absolute positions of a sequence's queries ``[q_len]`` and keys ``[context_len]``."""
    return (
        torch.arange(context_len - q_len, context_len, device=device),
        torch.arange(context_len, device=device),
    )


def _span_mask(
    context_len: int,
    q_len: int,
    spans: list[tuple[int, int]],
    device: torch.device,
) -> torch.Tensor | None:
    """``[q_len, context_len]`` bool: query and key in one bidirectional span; None when no
    span reaches this step's queries."""
    q_pos, k_pos = _positions(context_len, q_len, device)
    mask = None
    for first, end in spans:
        if end <= context_len - q_len or first >= context_len:
            continue
        if end > context_len:
            raise ValueError(f"bidirectional span [{first}, {end}) ends after this step")
        q_in = (q_pos >= first) & (q_pos < end)
        k_in = (k_pos >= first) & (k_pos < end)
        pair = q_in[:, None] & k_in[None, :]
        mask = pair if mask is None else mask | pair
    return mask


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    write_rows: torch.Tensor  # [2, T] int64: K and V row of each new token (``flat_rows``)
    # [T] int64: which token's K/V each write stores; None: its own. Padded rows of a
    # buffered decode step store the first real row's K/V at that row's slot.
    write_src: torch.Tensor | None
    decode_pages: torch.Tensor | None  # [Sd, P] int64, padded with page 0 (masked out)
    decode_rows: torch.Tensor | None  # [2, Sd * P * block_size] int64: K and V rows to gather
    decode_mask: torch.Tensor | None  # [Sd, 1, 1, P * block_size] bool
    prefills: list[PrefillPlan]
    decode_window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # by window

    def decode_mask_for(self, window: int | None) -> torch.Tensor | None:
        """``decode_mask`` of a layer seeing only the last ``window`` positions."""
        if window is None or self.decode_mask is None:
            return self.decode_mask
        if window not in self.decode_window_masks:
            length = self.decode_mask.shape[-1]
            key_pos = torch.arange(length, device=self.decode_mask.device)
            first = (self.context_lens[: self.num_decodes] - window)[:, None, None, None]
            self.decode_window_masks[window] = self.decode_mask & (key_pos >= first)
        return self.decode_window_masks[window]

    @property
    def write_blocks(self) -> torch.Tensor:  # [T] int64: page of each new token
        return torch.div(self.slot_mapping, self.block_size, rounding_mode="floor")

    @property
    def write_offsets(self) -> torch.Tensor:  # [T] int64: its offset in the page
        return self.slot_mapping % self.block_size


def flat_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache ``[num_blocks, 2, block_size, Hkv, D]`` as rows ``[num_blocks * 2 *
    block_size, Hkv, D]``: K of (page b, offset o) is row ``(2b) * block_size + o``, its V
    ``block_size`` rows later. A view, so reads and writes through it hit the cache."""
    if not kv_cache.is_contiguous():
        raise ValueError("TorchPagedAttention needs a contiguous KV cache")
    return kv_cache.view(-1, kv_cache.shape[-2], kv_cache.shape[-1])


def kv_rows(blocks: torch.Tensor, offsets: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[2, N]``: rows of K (0) and V (1) in ``flat_rows`` of tokens at ``blocks``/``offsets``."""
    k = (blocks * (2 * block_size) + offsets).flatten()
    return torch.stack((k, k + block_size))


def write_kv_cache(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    rows: torch.Tensor,  # [2, T] int64 K and V rows (``kv_rows``)
    src: torch.Tensor | None = None,  # [T] int64: token whose K/V each row stores
) -> None:
    """Store this step's K/V at their pages and offsets (two ``index_copy_``)."""
    flat = flat_rows(kv_cache)
    if src is not None:
        k, v = k.index_select(0, src), v.index_select(0, src)
    flat.index_copy_(0, rows[0], k.to(kv_cache.dtype))
    flat.index_copy_(0, rows[1], v.to(kv_cache.dtype))


def _gather(kv_cache: torch.Tensor, pages: torch.Tensor, length: int, index: int) -> torch.Tensor:
    """K (index 0) or V (1) of ``pages``, flattened to ``[length, Hkv, D]``."""
    return kv_cache[pages, index].flatten(0, 1)[:length]


class TorchPagedAttention:
    """``AttentionBackend`` with torch ops only (see ``attention.AttentionBackend``)."""

    # Not capturable in a CUDA graph: the decode gather is as wide as the step's longest
    # context, so shapes change from step to step (model/graph_buckets.py).
    graph_safe = False

    def prepare(self, batch: AttentionBatch, device: torch.device) -> TorchAttentionMetadata:
        base = build_metadata(batch, device)
        block_size = batch.block_size
        num_decodes = base.num_decodes
        decode_pages = decode_rows = decode_mask = None
        if num_decodes:
            pages = [-(-n // block_size) for n in batch.context_lens[:num_decodes]]
            width = max(pages)
            padded = [
                t[:n] + [0] * (width - n)
                for t, n in zip(batch.block_tables[:num_decodes], pages, strict=True)
            ]
            decode_pages = torch.tensor(padded, dtype=torch.long).to(device)  # [Sd, P]
            in_page = torch.arange(block_size, device=device)
            decode_rows = kv_rows(decode_pages[:, :, None], in_page, block_size)
            key_pos = torch.arange(width * block_size, device=device)  # [L]
            lengths = base.context_lens[:num_decodes, None]  # [Sd, 1]
            decode_mask = (key_pos[None, :] < lengths)[:, None, None, :]  # [Sd, 1, 1, L]
        prefills = []
        start = sum(batch.query_lens[:num_decodes])
        for seq in range(num_decodes, batch.num_seqs):
            q_len, ctx = batch.query_lens[seq], batch.context_lens[seq]
            end = start + q_len
            if q_len == 0:
                continue
            spans = batch.bidirectional[seq] if batch.bidirectional else []
            span_mask = _span_mask(ctx, q_len, spans, device) if spans else None
            cached_pages = None
            if q_len != ctx:
                num_pages = -(-ctx // block_size)
                pages_t = torch.tensor(batch.block_tables[seq][:num_pages], dtype=torch.long)
                cached_pages = pages_t.to(device)
            mask = None
            if cached_pages is not None or span_mask is not None:
                q_pos, k_pos = _positions(ctx, q_len, device)
                mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, ctx]
                if span_mask is not None:
                    mask |= span_mask
            prefills.append(PrefillPlan(start, end, ctx, cached_pages, mask, span_mask))
            start = end
        write_blocks = torch.div(base.slot_mapping, block_size, rounding_mode="floor")
        write_offsets = base.slot_mapping % block_size
        return TorchAttentionMetadata(
            **vars(base),
            write_rows=kv_rows(write_blocks, write_offsets, block_size),
            write_src=None,
            decode_pages=decode_pages,
            decode_rows=decode_rows,
            decode_mask=decode_mask,
            prefills=prefills,
        )

    def prepare_decode(self, buffers: DecodeBuffers, fill: DecodeFill) -> TorchAttentionMetadata:
        """The decode group's gather rows and mask computed into ``buffers`` (``out=``, no
        new tensors); the step's page width is that of its longest context."""
        base = buffer_metadata(buffers, fill)
        rows, width, block_size = fill.rows, fill.width, buffers.block_size
        length = width * block_size
        pages = buffers.decode_pages[: rows * width].view(rows, width)
        gather = buffers.decode_rows[: 2 * rows * length].view(2, rows, width, block_size)
        k_rows, v_rows = gather[0], gather[1]
        torch.mul(pages[:, :, None].expand(rows, width, block_size), 2 * block_size, out=k_rows)
        k_rows.add_(buffers.in_page)
        torch.add(k_rows, block_size, out=v_rows)
        mask = buffers.decode_mask[: rows * length].view(rows, 1, 1, length)
        torch.lt(buffers.key_pos[:length], base.context_lens[:, None, None, None], out=mask)
        return TorchAttentionMetadata(
            **vars(base),
            write_rows=buffers.write_rows[:, :rows],
            write_src=buffers.write_src[:rows],
            decode_pages=pages,
            decode_rows=gather.view(2, rows * length),
            decode_mask=mask,
            prefills=[],
        )

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        if not isinstance(meta, TorchAttentionMetadata):
            raise TypeError("TorchPagedAttention needs metadata from its own prepare()")
        write_kv_cache(k, v, kv_cache, meta.write_rows, meta.write_src)
        num_q_heads, num_kv_heads = q.shape[1], k.shape[1]
        gqa = num_q_heads != num_kv_heads
        out = torch.empty_like(q)  # [T, Hq, D]
        if meta.decode_pages is not None:
            rows = meta.num_decodes  # decodes own query rows 0..Sd-1, one each
            out[:rows] = self._decodes(q[:rows], kv_cache, meta, scale, window)
        for plan in meta.prefills:
            q_seq = q[plan.start : plan.end].transpose(0, 1)[None]  # [1, Hq, q_len, D]
            mask = plan.mask_for(window, q.device)
            if plan.pages is None and mask is None:  # nothing cached: attend over own K/V
                # Heads expanded by hand: with enable_gqa CPU SDPA leaves its flash path (2x).
                group = num_q_heads // num_kv_heads
                # 4-D inputs: CPU SDPA takes its flash path only with a batch dimension (10x)
                out[plan.start : plan.end] = F.scaled_dot_product_attention(
                    q_seq,
                    k[plan.start : plan.end].repeat_interleave(group, 1).transpose(0, 1)[None],
                    v[plan.start : plan.end].repeat_interleave(group, 1).transpose(0, 1)[None],
                    is_causal=True,
                    scale=scale,
                )[0].transpose(0, 1)
                continue
            if plan.pages is None:  # a masked prefill with nothing cached: its own K/V
                k_ctx, v_ctx = k[plan.start : plan.end], v[plan.start : plan.end]
            else:
                k_ctx = _gather(kv_cache, plan.pages, plan.context_len, 0).to(q.dtype)
                v_ctx = _gather(kv_cache, plan.pages, plan.context_len, 1).to(q.dtype)
            seq_out = F.scaled_dot_product_attention(
                q_seq,
                k_ctx.transpose(0, 1)[None],  # [1, Hkv, ctx, D]
                v_ctx.transpose(0, 1)[None],
                attn_mask=mask,
                scale=scale,
                enable_gqa=gqa,
            )  # [1, Hq, q_len, D]
            out[plan.start : plan.end] = seq_out[0].transpose(0, 1)
        return out

    @staticmethod
    def _decodes(
        q: torch.Tensor,  # [Sd, Hq, D]
        kv_cache: torch.Tensor,
        meta: TorchAttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:  # [Sd, Hq, D]
        assert meta.decode_rows is not None and meta.decode_mask is not None
        num_seqs, length = q.shape[0], meta.decode_mask.shape[-1]
        flat = flat_rows(kv_cache)
        shape = (num_seqs, length, *flat.shape[1:])  # [Sd, L, Hkv, D]
        k = flat.index_select(0, meta.decode_rows[0]).view(shape)
        v = flat.index_select(0, meta.decode_rows[1]).view(shape)
        k = k.transpose(1, 2).to(q.dtype)  # [Sd, Hkv, L, D]
        v = v.transpose(1, 2).to(q.dtype)
        out = F.scaled_dot_product_attention(
            q[:, :, None, :],  # [Sd, Hq, 1, D]
            k,
            v,
            attn_mask=meta.decode_mask_for(window),
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )  # [Sd, Hq, 1, D]
        return out[:, :, 0]
