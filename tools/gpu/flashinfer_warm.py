"""Compile FlashInfer's kernels before they are timed: one decode and one prefill plan/run at
the head size, dtypes and page size the GPU tests and bench-gpu use (FlashInfer compiles a
kernel with nvcc on its first use and caches it under ~/.cache/flashinfer)."""

from __future__ import annotations

import sys
import time

import torch


def main() -> int:
    try:
        import flashinfer
    except ImportError as exc:
        print(f"flashinfer not importable: {exc}")
        return 1
    print(f"flashinfer {flashinfer.__version__}", flush=True)
    page, heads, head_dim = 16, 32, 128
    pages = 8
    cache = torch.randn(pages, 2, page, heads, head_dim, dtype=torch.float16, device="cuda")
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    indptr = torch.tensor([0, pages], dtype=torch.int32, device="cuda")
    indices = torch.arange(pages, dtype=torch.int32, device="cuda")
    last = torch.tensor([page], dtype=torch.int32, device="cuda")
    for dtype in (torch.float16, torch.bfloat16):  # the tests and bench-gpu; bf16 models
        cache = cache.to(dtype)
        start = time.perf_counter()
        decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        decode.plan(indptr, indices, last, heads, heads, head_dim, page, q_data_type=dtype)
        decode.run(torch.randn(1, heads, head_dim, dtype=dtype, device="cuda"), cache)
        torch.cuda.synchronize()
        print(f"decode {dtype}: {time.perf_counter() - start:.1f} s", flush=True)
        start = time.perf_counter()
        prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
        qo = torch.tensor([0, pages * page], dtype=torch.int32, device="cuda")
        prefill.plan(qo, indptr, indices, last, heads, heads, head_dim, page, causal=True,
                     q_data_type=dtype)  # fmt: skip
        prefill.run(torch.randn(pages * page, heads, head_dim, dtype=dtype, device="cuda"), cache)
        torch.cuda.synchronize()
        print(f"prefill {dtype}: {time.perf_counter() - start:.1f} s", flush=True)
        start = time.perf_counter()  # the layer ops (model/layer_ops.py)
        x, r = (torch.randn(4, 4096, dtype=dtype, device="cuda") for _ in range(2))
        w = torch.randn(4096, dtype=dtype, device="cuda")
        flashinfer.norm.rmsnorm(x, w, 1e-5)
        flashinfer.norm.fused_add_rmsnorm(x, r, w, 1e-5)
        flashinfer.activation.silu_and_mul(torch.randn(4, 2 * 11008, dtype=dtype, device="cuda"))
        table = torch.randn(4096, head_dim, device="cuda")
        q = torch.randn(4, heads * head_dim, dtype=dtype, device="cuda")
        k = torch.randn(4, heads * head_dim, dtype=dtype, device="cuda")
        positions = torch.arange(4, device="cuda")
        flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(positions, q, k, head_dim, table)
        torch.cuda.synchronize()
        print(f"norm, activation, rope {dtype}: {time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
