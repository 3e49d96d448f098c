"""When a decode step replays a CUDA graph, and which one: pure decisions, no CUDA.

Graphs are captured once per *bucket*, the padded batch sizes the persistent decode
buffers already run at (``input_buffers.pad_sizes``), up to ``MAX_GRAPH_BATCH``. A
decode-only step on the buffers replays the smallest bucket that holds it; anything
else (a prefill in the step, a batch above the largest bucket, a caller that wants a
callback after each layer) runs eagerly.

Graphs need a graph-safe attention backend: FlashInfer in its CUDA-graph mode. The torch
backend is not one (its decode gather is as wide as the step's longest context, so its
tensor shapes change from step to step), so with it every step runs eagerly.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

MAX_GRAPH_BATCH = 256  # larger decode batches run eagerly (the launch overhead is amortised)


def graph_buckets(pad_sizes: Sequence[int], max_batch: int = MAX_GRAPH_BATCH) -> tuple[int, ...]:
    """The batch sizes to capture: the buffers' padded sizes up to ``max_batch``."""
    return tuple(sorted(s for s in set(pad_sizes) if 1 <= s <= max_batch))


def bucket_for(num_seqs: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= ``num_seqs``; None when none is (or ``num_seqs`` < 1)."""
    if num_seqs < 1 or not buckets:
        return None
    index = bisect.bisect_left(buckets, num_seqs)
    return buckets[index] if index < len(buckets) else None


def graph_or_eager(
    num_seqs: int, buckets: Sequence[int], decode_only: bool, layer_callback: bool
) -> int | None:
    """The bucket a step replays, or None: run it eagerly.

    ``decode_only``: every sequence appends one token and the step fits the persistent
    buffers. ``layer_callback``: the caller wants a call after each layer (a KV migration
    that follows the layers), which a replayed graph cannot make."""
    if not decode_only or layer_callback:
        return None
    return bucket_for(num_seqs, buckets)


def graphs_off_reason(
    requested: bool,
    device_type: str,
    graph_safe_attention: bool,
    has_buffers: bool,
) -> str | None:
    """Why this runner captures no graphs, or None when it captures them. M-RoPE models
    capture too: a decode token's one rotary position is read from the persistent buffers
    (checked on an H200 with Qwen2-VL-7B's shape: the tokens of 32 requests x 64 steps equal
    the eager run's, 2.6x shorter steps, docs/gpu.md)."""
    if not requested:
        return "turned off (--no-cuda-graphs)"
    if device_type != "cuda":
        return f"device type {device_type} is not CUDA"
    if not has_buffers:
        return "no persistent decode buffers (max_decode_seqs unset)"
    if not graph_safe_attention:
        return "the attention backend is not graph-safe (torch: shapes change per step)"
    return None
