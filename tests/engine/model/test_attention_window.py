"""TorchPagedAttention's sliding windows and bidirectional spans against dense attention
with the mask transformers builds for Gemma 3 (``kv > q - window``, or-ed with "same image")."""

from __future__ import annotations

import pytest
import torch

from epd_engine.model.attention import AttentionBatch
from epd_engine.model.attention_torch import TorchPagedAttention

HQ, HKV, D, BLOCK = 4, 2, 8, 4


def dense(q, k, v, window, spans, scale=0.3):  # [T, Hq, D], [T, Hkv, D] -> [T, Hq, D]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    pos = torch.arange(q.shape[0])
    distance = pos[:, None] - pos[None, :]
    allowed = distance >= 0
    if window is not None:
        allowed &= distance < window
    for first, end in spans:
        inside = (pos >= first) & (pos < end)
        allowed |= inside[:, None] & inside[None, :]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def run_in_steps(q, k, v, window, spans, steps):
    """Prefill in chunks of ``steps`` tokens, then one-token decodes for the rest."""
    backend = TorchPagedAttention()
    length = q.shape[0]
    table = [9, 2, 7, 0, 5, 1, 8, 3, 6, 4, 10, 11]
    kv_cache = torch.zeros(len(table), 2, BLOCK, HKV, D)
    outs, done = [], 0
    for size in [*steps, *[1] * (length - sum(steps))]:
        batch = AttentionBatch([size], [done + size], [table], BLOCK, [spans])
        meta = backend.prepare(batch, torch.device("cpu"))
        rows = slice(done, done + size)
        outs.append(backend.forward(q[rows], k[rows], v[rows], kv_cache, meta, 0.3, window))
        done += size
    return torch.cat(outs)


@pytest.mark.parametrize(
    ("window", "spans", "steps"),
    [
        (5, [], [30]),  # one prefill, the window inside it
        (5, [], [12, 7]),  # a chunk after cached pages, then decodes past the window
        (5, [(6, 14)], [30]),  # an image longer than the window: its tokens see it all
        (5, [(6, 14)], [14, 9]),  # the image in the first chunk, read back through pages
        (None, [(3, 9), (9, 12)], [20]),  # two adjacent images: each sees only itself
    ],
)
def test_windows_and_spans_match_dense_attention(window, spans, steps):
    gen = torch.Generator().manual_seed(0)
    length = 30
    q = torch.randn(length, HQ, D, generator=gen)
    k = torch.randn(length, HKV, D, generator=gen)
    v = torch.randn(length, HKV, D, generator=gen)
    ours = run_in_steps(q, k, v, window, spans, steps)
    torch.testing.assert_close(ours, dense(q, k, v, window, spans), atol=1e-5, rtol=1e-5)
    if window is not None:  # the window is not a no-op in these cases
        assert not torch.allclose(ours, dense(q, k, v, None, spans), atol=1e-3)


def test_a_span_split_across_steps_is_refused():
    """A span's later tokens are not in the cache yet when an earlier chunk runs."""
    backend = TorchPagedAttention()
    batch = AttentionBatch([8], [8], [[0, 1, 2]], BLOCK, [[(4, 12)]])
    with pytest.raises(ValueError, match="ends after this step"):
        backend.prepare(batch, torch.device("cpu"))
