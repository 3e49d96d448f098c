"""CUDA graphs of the language model's decode forward, one per bucket, captured at start-up.

Run on an H200 (docs/gpu.md; tests/engine/model/test_flashinfer_gpu.py).

Each graph runs embed -> layers -> final norm over the persistent decode buffers
(``input_buffers.DecodeBuffers``) at one padded batch size, with the attention backend's
CUDA-graph decode wrapper (``FlashInferAttention.prepare_graph_decode``). A replay is:
``DecodeBuffers.fill`` (done by the runner), re-plan that bucket's wrapper (page counts
change every step; plan runs outside the graph), ``graph.replay()``. The output is a
fixed tensor, overwritten by the next replay of that bucket.

Capture writes a dummy decode (token 0 at position 0 on page 0) into the KV cache: at
start-up no request owns a page, and a request overwrites every slot it later reads.
Graphs are captured largest first into one memory pool, so the smaller ones reuse it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from epd_engine.model.input_buffers import DecodeBuffers, DecodeFill

log = logging.getLogger(__name__)

WARMUP_RUNS = 2  # eager runs before a capture: lazy initialisation (cuBLAS, JIT) stays out


def capture_graph(
    fn: Callable[[], torch.Tensor], warmup: int = WARMUP_RUNS, pool: Any = None
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``fn`` run ``warmup`` times eagerly on a side stream (as torch asks before a
    capture), then captured once: the graph and its output tensor (rewritten by each
    replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


class DecodeGraphs:
    def __init__(
        self,
        language: Any,  # LlavaLanguage (or a model with the same decode forward)
        buffers: DecodeBuffers,
        kv_caches: list[torch.Tensor],
        buckets: tuple[int, ...],
    ) -> None:
        attention = language.attention
        if not getattr(attention, "graph_safe", False):
            raise ValueError(f"{type(attention).__name__} cannot run in a CUDA graph")
        missing = [b for b in buckets if b not in buffers.sizes]
        if missing:
            raise ValueError(f"buckets {missing} are not padded sizes of the decode buffers")
        self.language = language
        self.attention = attention
        self.buffers = buffers
        self.kv_caches = kv_caches
        self.buckets = buckets
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _forward(self, rows: int, meta: Any) -> torch.Tensor:  # [rows, H]
        embeds = self.language.embed(self.buffers.input_ids[:rows])
        return self.language(embeds, meta.positions, self.kv_caches, meta)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for rows in sorted(self.buckets, reverse=True):
            fill = self.buffers.fill([0] * rows, [1] * rows, [[0]] * rows)
            meta = self.attention.prepare_graph_decode(self.buffers, fill)
            self._graphs[rows] = capture_graph(partial(self._forward, rows, meta), pool=pool)
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", sorted(self._graphs))

    def plan(self, fill: DecodeFill) -> None:
        """The attention's plan for a step ``fill`` wrote: new page table, same addresses."""
        self.attention.prepare_graph_decode(self.buffers, fill)

    def replay(self, fill: DecodeFill) -> torch.Tensor:
        """Hidden states ``[fill.rows, H]`` of a step ``fill`` wrote and ``plan`` planned."""
        graph, out = self._graphs[fill.rows]
        graph.replay()
        return out
