"""TorchPagedAttention against a dense causal attention written out by hand."""

from __future__ import annotations

import torch

from epd_engine.model.attention_torch import TorchPagedAttention
from epd_engine.model.generate import single_sequence_metadata


def dense_causal_attention(q, k, v, scale):  # [T, Hq, D], [T, Hkv, D] -> [T, Hq, D]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, T, T]
    causal = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def test_paged_attention_with_gqa_matches_dense_and_fills_the_cache():
    gen = torch.Generator().manual_seed(0)
    num_tokens, hq, hkv, d, block_size = 11, 4, 2, 8, 4
    q = torch.randn(num_tokens, hq, d, generator=gen)
    k = torch.randn(num_tokens, hkv, d, generator=gen)
    v = torch.randn(num_tokens, hkv, d, generator=gen)
    kv_cache = torch.zeros(6, 2, block_size, hkv, d)
    block_table = [5, 0, 3]
    backend = TorchPagedAttention()
    out_first = backend.forward(
        q[:6], k[:6], v[:6], kv_cache, single_sequence_metadata(block_table, 0, 6, block_size), 0.3
    )
    out_rest = backend.forward(
        q[6:], k[6:], v[6:], kv_cache, single_sequence_metadata(block_table, 6, 5, block_size), 0.3
    )
    expected = dense_causal_attention(q, k, v, 0.3)
    torch.testing.assert_close(torch.cat([out_first, out_rest]), expected, atol=1e-5, rtol=1e-5)
    # Token 5 sits in page block_table[1] = 0 at offset 1.
    torch.testing.assert_close(kv_cache[0, 0, 1], k[5])
    torch.testing.assert_close(kv_cache[0, 1, 1], v[5])


def test_batched_decodes_of_different_lengths_match_dense_per_sequence():
    """Several one-token decodes in one batch (the padded, masked SDPA path)."""
    from epd_engine.model.attention import AttentionBatch

    gen = torch.Generator().manual_seed(1)
    hq, hkv, d, block_size = 4, 2, 8, 4
    lengths = [3, 9, 6]  # tokens per sequence including the one decoded now
    tables = [[7], [1, 4, 2], [6, 0]]
    kv_cache = torch.zeros(8, 2, block_size, hkv, d)
    backend = TorchPagedAttention()
    seqs = []
    for length, table in zip(lengths, tables, strict=True):
        q = torch.randn(length, hq, d, generator=gen)
        k = torch.randn(length, hkv, d, generator=gen)
        v = torch.randn(length, hkv, d, generator=gen)
        meta = single_sequence_metadata(table, 0, length - 1, block_size)
        backend.forward(q[:-1], k[:-1], v[:-1], kv_cache, meta, 0.3)  # prefill all but the last
        seqs.append((q, k, v))
    meta = backend.prepare(
        AttentionBatch([1, 1, 1], lengths, tables, block_size), torch.device("cpu")
    )
    out = backend.forward(
        torch.stack([q[-1] for q, _, _ in seqs]),
        torch.stack([k[-1] for _, k, _ in seqs]),
        torch.stack([v[-1] for _, _, v in seqs]),
        kv_cache,
        meta,
        0.3,
    )
    for row, (q, k, v) in enumerate(seqs):
        expected = dense_causal_attention(q, k, v, 0.3)[-1]
        torch.testing.assert_close(out[row], expected, atol=1e-5, rtol=1e-5)
