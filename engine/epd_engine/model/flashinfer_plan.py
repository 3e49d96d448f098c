"""FlashInfer ``plan`` arguments from one step's metadata: pure, host tensors, no kernel.

Sequences ``[0, num_decodes)`` (one new token each, after a cached context) go to
``BatchDecodeWithPagedKVCacheWrapper``, the rest to ``BatchPrefillWithPagedKVCacheWrapper``
with ``causal=True`` (FlashInfer aligns a causal mask to the end of the KV, so a chunk after
cached tokens sees them all). Each group's indptrs are re-based to start at 0 and its
``kv_indices`` are a slice of the step's device ``kv_indices`` (no copy). The indptrs and
``last_page_len`` are *host* int32 tensors: ``plan`` reads them on the host anyway (a device
tensor costs a device-to-host sync there) and copies them to the device itself.

Keyword names are those of flashinfer-python 0.5.3's ``plan`` (``decode.py``: ``indptr``,
``indices``, ``last_page_len``, ``head_dim``, ``page_size``; ``prefill.py``: ``qo_indptr``,
``paged_kv_indptr``, ``paged_kv_indices``, ``paged_kv_last_page_len``, ``head_dim_qk``,
``page_size``, ``causal``); both take ``q_data_type``, ``kv_data_type``, ``sm_scale``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from epd_engine.model.attention import AttentionMetadata

# Head sizes FlashInfer builds and tests its kernels for (its AOT list); others may not compile.
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class FlashInferPlan:
    """Keyword arguments of each wrapper's ``plan`` (None: the group is empty this step)."""

    decode: dict[str, Any] | None
    prefill: dict[str, Any] | None
    decode_rows: int  # query rows [0, decode_rows) are the decode group's, the rest prefill's
    sm_scale: float


def _int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _indptr(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def flashinfer_plan_args(
    meta: AttentionMetadata,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> FlashInferPlan:
    """Split ``meta`` into the decode and prefill groups and build each ``plan``'s arguments.

    A prefill sequence with no new tokens this step is left out of the prefill group (it
    owns no query rows)."""
    block_size = meta.block_size
    q_lens, ctx_lens = meta.query_lens_host, meta.context_lens_host
    pages = [-(-ctx // block_size) for ctx in ctx_lens]
    page_start = _indptr(pages)  # where each sequence's pages sit in meta.kv_indices
    last = [ctx - (p - 1) * block_size for ctx, p in zip(ctx_lens, pages, strict=True)]
    nd = meta.num_decodes
    common = {
        "num_qo_heads": num_qo_heads,
        "num_kv_heads": num_kv_heads,
        "page_size": block_size,
        "pos_encoding_mode": "NONE",  # RoPE is applied before attention
        "q_data_type": dtype,
        "kv_data_type": dtype,
        "sm_scale": head_dim**-0.5,
    }
    decode = None
    if nd:
        decode = {
            "indptr": _int32(_indptr(pages[:nd])),
            "indices": meta.kv_indices[: page_start[nd]],
            "last_page_len": _int32(last[:nd]),
            "head_dim": head_dim,
            **common,
        }
    seqs = [i for i in range(nd, meta.num_seqs) if q_lens[i] > 0]
    prefill = None
    if seqs:
        if seqs == list(range(nd, meta.num_seqs)):
            indices = meta.kv_indices[page_start[nd] : page_start[-1]]
        else:
            parts = [meta.kv_indices[page_start[i] : page_start[i + 1]] for i in seqs]
            indices = torch.cat(parts)
        prefill = {
            "qo_indptr": _int32(_indptr([q_lens[i] for i in seqs])),
            "paged_kv_indptr": _int32(_indptr([pages[i] for i in seqs])),
            "paged_kv_indices": indices,
            "paged_kv_last_page_len": _int32([last[i] for i in seqs]),
            "head_dim_qk": head_dim,
            "causal": True,
            **common,
        }
    return FlashInferPlan(decode, prefill, sum(q_lens[:nd]), head_dim**-0.5)


def unsupported_reason(head_dim: int, dtype: torch.dtype) -> str | None:
    """Why FlashInfer cannot run this model's attention, or None when it can."""
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} (FlashInfer runs float16 and bfloat16)"
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {head_dim} (FlashInfer's kernels are built for {SUPPORTED_HEAD_DIMS})"
    return None
