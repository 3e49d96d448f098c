"""Reference paged attention in plain torch: the CPU path and the yardstick for GPU kernels.

Three cases, each one SDPA call per group so CPU time goes to math, not Python:
- decodes (one new token each) are batched: pages gathered into a padded ``[S, L]`` K/V
  with a length mask;
- a prefill with nothing cached attends over its own K/V with ``is_causal`` (SDPA's fast
  path; an explicit mask would send it down the slow general path);
- a chunk after cached tokens gathers its pages and uses a causal mask offset by them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from epd_engine.model.attention import AttentionMetadata


def write_kv_cache(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
    block_size: int,
) -> None:
    """Store this step's K/V at their slots (``block_id * block_size + offset``)."""
    slots = slot_mapping.to(kv_cache.device)
    block_ids = torch.div(slots, block_size, rounding_mode="floor")  # [T]
    offsets = slots % block_size  # [T]
    kv_cache[block_ids, 0, offsets] = k.to(kv_cache.dtype)
    kv_cache[block_ids, 1, offsets] = v.to(kv_cache.dtype)


def gather_kv(
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    block_table: list[int],
    context_len: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first ``context_len`` cached K and V, each ``[context_len, Hkv, D]``."""
    num_pages = -(-context_len // block_size)
    if num_pages > len(block_table):
        raise ValueError(f"block table has {len(block_table)} pages, need {num_pages}")
    pages = torch.tensor(block_table[:num_pages], dtype=torch.long, device=kv_cache.device)
    kv = kv_cache.index_select(0, pages)  # [n, 2, block_size, Hkv, D]
    k = kv[:, 0].flatten(0, 1)[:context_len]  # [ctx, Hkv, D]
    v = kv[:, 1].flatten(0, 1)[:context_len]
    return k, v


def _decode_batch(
    q: torch.Tensor,  # [S, Hq, D]: one new token per sequence
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    block_tables: list[list[int]],
    context_lens: list[int],
    block_size: int,
    scale: float,
) -> torch.Tensor:  # [S, Hq, D]
    num_pages = [-(-n // block_size) for n in context_lens]
    max_pages = max(num_pages)
    # pad every table to max_pages with page 0: those keys are masked out below
    padded = [t[:n] + [0] * (max_pages - n) for t, n in zip(block_tables, num_pages, strict=True)]
    pages = torch.tensor(padded, dtype=torch.long, device=kv_cache.device)  # [S, P]
    kv = kv_cache[pages]  # [S, P, 2, block_size, Hkv, D]
    k = kv[:, :, 0].flatten(1, 2).transpose(1, 2).to(q.dtype)  # [S, Hkv, L, D]
    v = kv[:, :, 1].flatten(1, 2).transpose(1, 2).to(q.dtype)
    lengths = torch.tensor(context_lens, device=q.device)  # [S]
    positions = torch.arange(k.shape[2], device=q.device)  # [L]
    mask = (positions[None, :] < lengths[:, None])[:, None, None, :]  # [S, 1, 1, L]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :],  # [S, Hq, 1, D]
        k,
        v,
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )  # [S, Hq, 1, D]
    return out[:, :, 0]


class TorchPagedAttention:
    """``AttentionBackend`` with torch ops only (see ``attention.AttentionBackend``)."""

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv_cache(k, v, kv_cache, meta.slot_mapping, meta.block_size)
        num_q_heads, num_kv_heads = q.shape[1], k.shape[1]
        gqa = num_q_heads != num_kv_heads
        out = torch.empty_like(q)  # [T, Hq, D]
        decodes: list[int] = []
        for seq in range(meta.num_seqs):
            start, end = meta.query_start_loc[seq], meta.query_start_loc[seq + 1]
            q_len, context_len = end - start, meta.context_lens[seq]
            if q_len == 0:
                continue
            if q_len > context_len:
                raise ValueError(f"sequence {seq}: {q_len} new tokens but context {context_len}")
            if q_len == 1 and context_len > 1:
                decodes.append(seq)
                continue
            if q_len == context_len:  # nothing cached before: attend over this step's K/V
                # Heads expanded by hand: with enable_gqa CPU SDPA leaves its flash path (2x).
                group = num_q_heads // num_kv_heads
                # 4-D inputs: CPU SDPA takes its flash path only with a batch dimension (10x)
                out[start:end] = F.scaled_dot_product_attention(
                    q[start:end].transpose(0, 1)[None],  # [1, Hq, q_len, D]
                    k[start:end].repeat_interleave(group, 1).transpose(0, 1)[None],
                    v[start:end].repeat_interleave(group, 1).transpose(0, 1)[None],
                    is_causal=True,
                    scale=scale,
                )[0].transpose(0, 1)
                continue
            k_ctx, v_ctx = gather_kv(kv_cache, meta.block_tables[seq], context_len, meta.block_size)
            # Query j sits at position context_len - q_len + j and sees keys 0..that position.
            q_pos = torch.arange(context_len - q_len, context_len, device=q.device)  # [q_len]
            k_pos = torch.arange(context_len, device=q.device)  # [ctx]
            mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, ctx]
            seq_out = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1)[None],  # [1, Hq, q_len, D]
                k_ctx.to(q.dtype).transpose(0, 1)[None],  # [1, Hkv, ctx, D]
                v_ctx.to(q.dtype).transpose(0, 1)[None],
                attn_mask=mask,
                scale=scale,
                enable_gqa=gqa,
            )  # [1, Hq, q_len, D]
            out[start:end] = seq_out[0].transpose(0, 1)
        if decodes:
            rows = [meta.query_start_loc[seq] for seq in decodes]
            out[rows] = _decode_batch(
                q[rows],
                kv_cache,
                [meta.block_tables[seq] for seq in decodes],
                [meta.context_lens[seq] for seq in decodes],
                meta.block_size,
                scale,
            )
        return out
