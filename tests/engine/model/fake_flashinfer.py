"""A stand-in for the ``flashinfer`` module on CPU: the two paged wrappers with the
constructor and ``plan`` parameters of flashinfer-python 0.5.3 and a ``run`` written in plain
torch from FlashInfer's documented semantics (CSR page table, causal mask aligned to the end
of the KV). It lets ``FlashInferAttention``'s slicing, cache writes and CUDA-graph buffers be
checked without a GPU; the kernels themselves are checked by the ``gpu`` tests."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

# Parameter names of flashinfer-python 0.5.3's plan() (decode.py, prefill.py), in order.
DECODE_PLAN_PARAMS = (
    "indptr", "indices", "last_page_len", "num_qo_heads", "num_kv_heads", "head_dim",
    "page_size", "pos_encoding_mode", "window_left", "logits_soft_cap", "q_data_type",
    "kv_data_type", "data_type", "sm_scale", "rope_scale", "rope_theta", "non_blocking",
    "block_tables", "seq_lens", "fixed_split_size", "disable_split_kv",
)  # fmt: skip
PREFILL_PLAN_PARAMS = (
    "qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len",
    "num_qo_heads", "num_kv_heads", "head_dim_qk", "page_size", "head_dim_vo", "custom_mask",
    "packed_custom_mask", "causal", "pos_encoding_mode", "use_fp16_qk_reduction", "sm_scale",
    "window_left", "logits_soft_cap", "rope_scale", "rope_theta", "q_data_type",
    "kv_data_type", "non_blocking", "prefix_len_ptr", "token_pos_in_items_ptr",
    "token_pos_in_items_len", "max_item_len_ptr", "seq_lens", "seq_lens_q", "block_tables",
    "max_token_per_sequence", "max_sequence_kv", "fixed_split_size", "disable_split_kv",
)  # fmt: skip


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, page, Hkv, D]
    qo_indptr: list[int],
    kv_indptr: list[int],
    kv_indices: list[int],
    last_page_len: list[int],
    causal: bool,
    sm_scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    page = kv_cache.shape[2]
    out = torch.empty_like(q)
    group = q.shape[1] // kv_cache.shape[3]
    for i in range(len(qo_indptr) - 1):
        start, end = qo_indptr[i], qo_indptr[i + 1]
        pages = kv_indices[kv_indptr[i] : kv_indptr[i + 1]]
        kv_len = (len(pages) - 1) * page + last_page_len[i]
        k = kv_cache[pages, 0].flatten(0, 1)[:kv_len].float().repeat_interleave(group, 1)
        v = kv_cache[pages, 1].flatten(0, 1)[:kv_len].float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * sm_scale
        if causal:
            q_pos = torch.arange(kv_len - (end - start), kv_len)
            keep = torch.arange(kv_len)[None, :] <= q_pos[:, None]
            scores = scores.masked_fill(~keep, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


class _Wrapper:
    causal = False

    def __init__(self, use_cuda_graph: bool, indptr: Any, indices: Any, last: Any) -> None:
        self.use_cuda_graph = use_cuda_graph
        self.buffers = (indptr, indices, last) if use_cuda_graph else None
        self.plans: list[dict[str, Any]] = []

    def _store(self, qo: Any, indptr: Any, indices: Any, last: Any, sm_scale: Any) -> None:
        if self.buffers is not None:  # CUDA-graph mode: fixed sizes, copied into the buffers
            buf_indptr, buf_indices, buf_last = self.buffers
            assert len(last) == len(buf_last), "batch size is fixed in CUDA-graph mode"
            buf_indptr.copy_(indptr)
            buf_last.copy_(last)
            buf_indices[: len(indices)].copy_(indices)
            indptr, last = buf_indptr, buf_last
            indices = buf_indices[: len(indices)]
        self.state = (list(qo), indptr, indices, last, sm_scale)

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        assert out.shape == q.shape and out.dtype == q.dtype
        qo, indptr, indices, last, sm_scale = self.state
        pages = (indptr.tolist(), indices.tolist(), last.tolist())
        out.copy_(paged_attention(q, kv_cache, qo, *pages, self.causal, sm_scale))
        return out


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: Any = None,
        paged_kv_indices_buffer: Any = None,
        paged_kv_last_page_len_buffer: Any = None,
    ) -> None:
        assert kv_layout == "NHD"
        super().__init__(
            use_cuda_graph,
            paged_kv_indptr_buffer,
            paged_kv_indices_buffer,
            paged_kv_last_page_len_buffer,
        )

    def plan(self, **kwargs: Any) -> None:
        assert set(kwargs) <= set(DECODE_PLAN_PARAMS), set(kwargs) - set(DECODE_PLAN_PARAMS)
        self.plans.append(kwargs)
        rows = len(kwargs["last_page_len"])
        self._store(
            range(rows + 1),
            kwargs["indptr"],
            kwargs["indices"],
            kwargs["last_page_len"],
            kwargs["sm_scale"],
        )


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    def __init__(
        self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", backend: str = "auto"
    ) -> None:
        assert kv_layout == "NHD" and backend in ("auto", "fa2", "fa3")
        super().__init__(False, None, None, None)

    def plan(self, **kwargs: Any) -> None:
        assert set(kwargs) <= set(PREFILL_PLAN_PARAMS), set(kwargs) - set(PREFILL_PLAN_PARAMS)
        self.plans.append(kwargs)
        self.causal = kwargs["causal"]
        self._store(
            kwargs["qo_indptr"].tolist(),
            kwargs["paged_kv_indptr"],
            kwargs["paged_kv_indices"],
            kwargs["paged_kv_last_page_len"],
            kwargs["sm_scale"],
        )


def fake_flashinfer() -> SimpleNamespace:
    return SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=BatchDecodeWithPagedKVCacheWrapper,
        BatchPrefillWithPagedKVCacheWrapper=BatchPrefillWithPagedKVCacheWrapper,
    )
