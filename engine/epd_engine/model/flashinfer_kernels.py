"""Whether FlashInfer has a model's kernels on this machine, before the engine picks it.

FlashInfer loads a kernel module from its AOT directory when one is built there (the GPU image
builds the engine's for head size 128, every supported family's: ``tools/images/
flashinfer_aot.py``), else compiles it with nvcc on first use (its JIT). Where neither works
-- a head size the image did not build, and no nvcc -- the first step would fail; asked here
first, ``auto`` falls back to torch attention with the reason and an explicit ``flashinfer``
is refused with it (``attention_select.py``).

The module names are FlashInfer's own (``get_batch_*_uri``) for the arguments the engine
plans with (``flashinfer_plan.py``: int32 indices, no in-kernel positional encoding, no
sliding window or logits cap; FA2 prefill, also the tensor-core decode).
"""

from __future__ import annotations

from pathlib import Path

import torch

LAYER_OP_MODULES = ("norm", "rope", "silu_and_mul")  # layer_ops.py's kernels


def kernel_modules(head_dim: int, dtype: torch.dtype) -> list[str]:
    """The FlashInfer modules an engine with this head size and dtype loads."""
    from flashinfer.jit import get_batch_decode_uri, get_batch_prefill_uri

    args = (dtype, dtype, dtype, torch.int32, head_dim, head_dim, 0, False, False)
    return [
        get_batch_decode_uri(*args),
        get_batch_prefill_uri("fa2", *args, False),
        *LAYER_OP_MODULES,
    ]


def missing_kernels_reason(head_dim: int, dtype: torch.dtype) -> str | None:
    """Why FlashInfer cannot get this model's kernels here, or None when it can (all built
    ahead of time, or nvcc at hand to compile the rest). None too when FlashInfer does not
    import: ``flashinfer_import_error`` reports that."""
    try:
        from flashinfer.jit import env as jit_env
        from flashinfer.jit.cpp_ext import get_cuda_path
    except Exception:
        return None
    aot = Path(jit_env.FLASHINFER_AOT_DIR)
    missing = [m for m in kernel_modules(head_dim, dtype) if not (aot / m / f"{m}.so").is_file()]
    if not missing:
        return None
    try:
        nvcc = Path(get_cuda_path()) / "bin" / "nvcc"
    except RuntimeError:  # no CUDA_HOME, no nvcc on PATH, no /usr/local/cuda
        nvcc = None
    if nvcc is not None and nvcc.is_file():
        return None  # FlashInfer's JIT compiles them on first use
    return (
        f"FlashInfer's kernels for head_dim {head_dim} {dtype} are not built in ({missing[0]} "
        f"missing from {aot}) and there is no nvcc to compile them"
    )
