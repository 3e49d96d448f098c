"""FlashInfer paged attention on the per-step seam (``attention.AttentionBackend``).

Run on an H200 (docs/gpu.md; tests/engine/model/test_flashinfer_gpu.py).

``prepare`` (once per step) builds the shared metadata, then plans
``BatchDecodeWithPagedKVCacheWrapper`` for the decode group and
``BatchPrefillWithPagedKVCacheWrapper`` (causal) for the rest (``flashinfer_plan``).
``forward`` (every layer) writes this step's K/V into the ``[num_blocks, 2, block, Hkv, D]``
cache (NHD) with two ``index_copy_`` and runs the planned wrappers on the two slices of ``q``.
The wrappers and their workspace are allocated once, with the backend; a step's metadata
is valid until the next ``prepare``, which re-plans the same wrappers.

CUDA graphs: ``prepare_graph_decode`` plans a decode wrapper in FlashInfer's CUDA-graph mode
(``use_cuda_graph=True``), one per padded batch size, whose indptr / indices /
last_page_len live in fixed device buffers; a graph captured over its ``run`` reads the
step's page table from them, so re-planning before each replay is enough. This is why this
backend is graph-safe and the torch one is not (its decode gather width changes with the
longest context, so its shapes change from step to step).

flashinfer is imported lazily: the package is only on GPU machines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from epd_engine.model.attention import (
    AttentionBatch,
    AttentionMetadata,
    buffer_metadata,
    build_metadata,
)
from epd_engine.model.attention_torch import kv_rows, write_kv_cache
from epd_engine.model.flashinfer_plan import flashinfer_plan_args, unsupported_reason
from epd_engine.model.input_buffers import DecodeBuffers, DecodeFill

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace (split-k)
KV_LAYOUT = "NHD"  # the cache's [block, Hkv, D] order
# FlashInfer's FA2 prefill kernels on every GPU generation: one quick JIT build. ("auto"
# picks FA3 on Hopper, faster for long prefills but minutes more of JIT build: measure first.)
PREFILL_BACKEND = "fa2"


def import_flashinfer() -> Any:
    import flashinfer  # GPU machines only

    return flashinfer


@dataclass
class FlashInferMetadata(AttentionMetadata):
    write_rows: torch.Tensor  # [2, T] int64: K and V row of each new token (``flat_rows``)
    write_src: torch.Tensor | None  # [T] int64: token each write stores (padded decode rows)
    decode_rows: int  # query rows [0, decode_rows) are the decode group's
    decode_wrapper: Any  # planned BatchDecodeWithPagedKVCacheWrapper, or None
    prefill_wrapper: Any  # planned BatchPrefillWithPagedKVCacheWrapper, or None
    sm_scale: float


class FlashInferAttention:
    """``AttentionBackend`` with FlashInfer kernels (CUDA, float16/bfloat16)."""

    graph_safe = True
    fused_layer_ops = True  # the layers run FlashInfer's norm/activation/RoPE too (layer_ops)

    def __init__(
        self,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        workspace_bytes: int = WORKSPACE_BYTES,
    ) -> None:
        reason = unsupported_reason(head_dim, dtype)
        if reason is not None:
            raise ValueError(f"FlashInfer attention cannot run {reason}")
        self.flashinfer = import_flashinfer()
        self.num_qo_heads, self.num_kv_heads = num_qo_heads, num_kv_heads
        self.head_dim, self.dtype = head_dim, dtype
        self.device = torch.device(device)
        # one workspace for every wrapper: their runs are sequential on one stream
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        # vLLM's rule: tensor-core decode (the prefill kernel) pays off for GQA groups >= 4;
        # the CUDA-core decode kernel is only built for groups 1, 2, 3, 4 and 8 anyway
        self.tensor_core_decode = num_qo_heads // num_kv_heads >= 4
        self.decode = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, KV_LAYOUT, use_tensor_cores=self.tensor_core_decode
        )
        self.prefill = self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, KV_LAYOUT, backend=PREFILL_BACKEND
        )
        self._graph_decode: dict[int, Any] = {}  # padded batch size -> CUDA-graph wrapper
        self._graph_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    # ---- prepare: once per step ---------------------------------------------------------
    def prepare(self, batch: AttentionBatch, device: torch.device) -> FlashInferMetadata:
        if batch.bidirectional:
            raise NotImplementedError("FlashInferAttention has no bidirectional spans yet")
        base = build_metadata(batch, device)
        block_size = batch.block_size
        blocks = torch.div(base.slot_mapping, block_size, rounding_mode="floor")
        rows = kv_rows(blocks, base.slot_mapping % block_size, block_size)
        return self._plan(base, rows, None, self.decode)

    def prepare_decode(self, buffers: DecodeBuffers, fill: DecodeFill) -> FlashInferMetadata:
        base = buffer_metadata(buffers, fill)
        rows = fill.rows
        return self._plan(base, buffers.write_rows[:, :rows], buffers.write_src[:rows], self.decode)

    def prepare_graph_decode(self, buffers: DecodeBuffers, fill: DecodeFill) -> FlashInferMetadata:
        """``prepare_decode`` on the CUDA-graph wrapper of batch size ``fill.rows``: every
        tensor a captured forward reads sits at a fixed address (buffers' views, the
        wrapper's fixed buffers); planning again before a replay updates their contents."""
        base = buffer_metadata(buffers, fill)
        rows = fill.rows
        wrapper = self._graph_wrapper(rows, buffers)
        return self._plan(base, buffers.write_rows[:, :rows], buffers.write_src[:rows], wrapper)

    def _graph_wrapper(self, rows: int, buffers: DecodeBuffers) -> Any:
        wrapper = self._graph_decode.get(rows)
        if wrapper is not None:
            return wrapper
        if self._graph_buffers is None:  # shared by every size: one size runs per step
            cap, device = buffers.capacity, self.device
            self._graph_buffers = (
                torch.zeros(cap + 1, dtype=torch.int32, device=device),  # indptr
                torch.zeros(cap * buffers.max_pages, dtype=torch.int32, device=device),  # indices
                torch.zeros(cap, dtype=torch.int32, device=device),  # last_page_len
            )
        indptr, indices, last = self._graph_buffers
        wrapper = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            KV_LAYOUT,
            use_cuda_graph=True,
            use_tensor_cores=self.tensor_core_decode,
            paged_kv_indptr_buffer=indptr[: rows + 1],
            paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=last[:rows],
        )
        self._graph_decode[rows] = wrapper
        return wrapper

    def _plan(
        self,
        base: AttentionMetadata,
        write_rows: torch.Tensor,
        write_src: torch.Tensor | None,
        decode_wrapper: Any,
    ) -> FlashInferMetadata:
        plan = flashinfer_plan_args(
            base, self.num_qo_heads, self.num_kv_heads, self.head_dim, self.dtype
        )
        if plan.decode is not None:
            decode_wrapper.plan(**plan.decode)
        if plan.prefill is not None:
            self.prefill.plan(**plan.prefill)
        return FlashInferMetadata(
            **vars(base),
            write_rows=write_rows,
            write_src=write_src,
            decode_rows=plan.decode_rows,
            decode_wrapper=decode_wrapper if plan.decode is not None else None,
            prefill_wrapper=self.prefill if plan.prefill is not None else None,
            sm_scale=plan.sm_scale,
        )

    # ---- forward: every layer -----------------------------------------------------------
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
        if not isinstance(meta, FlashInferMetadata):
            raise TypeError("FlashInferAttention needs metadata from its own prepare()")
        if window is not None:  # planned per step, not per layer: not wired yet
            raise NotImplementedError("FlashInferAttention has no sliding-window layers yet")
        if abs(scale - meta.sm_scale) > 1e-6 * meta.sm_scale:  # planned, not passed per run
            raise ValueError(f"scale {scale} differs from the planned {meta.sm_scale}")
        write_kv_cache(k, v, kv_cache, meta.write_rows, meta.write_src)
        out = torch.empty_like(q)
        rows = meta.decode_rows
        if meta.decode_wrapper is not None:
            meta.decode_wrapper.run(q[:rows], kv_cache, out=out[:rows])
        if meta.prefill_wrapper is not None:
            meta.prefill_wrapper.run(q[rows:], kv_cache, out=out[rows:])
        return out
