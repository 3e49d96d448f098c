"""FlashInfer's kernels the engine runs, compiled ahead of time into the GPU image.

FlashInfer compiles a kernel with nvcc the first time it is used (its JIT) unless a built
``<name>.so`` sits in its AOT directory (``flashinfer/data/aot/<name>/<name>.so`` inside the
package; ``JitSpec.is_aot``), which it then loads as it is. The GPU engine image
(``docker/engine.Dockerfile``, ``VARIANT=gpu``) runs ``build`` with a CUDA toolchain from
PyPI wheels that the same step removes again, so a pod compiles nothing at start and needs no
nvcc.

What is built is what the engine asks FlashInfer for (``model/attention_flashinfer.py``,
``model/layer_ops.py``; the names ``model/flashinfer_kernels.py`` looks up): paged batch
decode (CUDA cores) and FA2 paged batch prefill (also the tensor-core decode), float16 and
bfloat16, no positional encoding in the kernel, no sliding window, no logits cap; RMSNorm,
RoPE and silu*mul. Head size 128 only: every supported family's (LLaVA-1.5/1.6 on LLaMA,
Vicuna, Mistral; Qwen2-VL, Qwen2.5-VL); FlashInfer also runs 64 and 256, which would double
the build, and a model with those gets torch attention in the image, with a log line saying
why (``flashinfer_kernels.missing_kernels_reason``). ``tests/images/test_dockerfiles.py``
and ``test_gpu_image.py`` keep these lists equal to the engine's.

    FLASHINFER_CUDA_ARCH_LIST="9.0" CUDA_HOME=... python flashinfer_aot.py build
    FLASHINFER_CUDA_ARCH_LIST=8.0 FLASHINFER_DISABLE_JIT=1 python flashinfer_aot.py check

``check`` loads every module from the AOT directory with FlashInfer's JIT off (no GPU needed:
loading links the CUDA runtime, not the driver) and fails naming any module that is missing.
This file imports no epd_engine module: the image runs it before the project is installed.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# of the engine's FlashInfer shapes (epd_engine.model.flashinfer_plan.SUPPORTED_*)
HEAD_DIMS = (128,)
DTYPES = ("float16", "bfloat16")
# Where the kernels run: SASS for each major generation (a cubin runs on any later minor of
# its major): 8.0 A100, A10, A30, L4, L40 (8.6/8.9); 9.0 H100, H200; 10.0 B200, B300 (10.3);
# 12.0 RTX PRO 6000 Blackwell, GeForce RTX 50xx. FA2 needs no arch-specific ("a") features.
DEFAULT_ARCHS = "8.0 9.0 10.0 12.0"


def engine_specs() -> Iterator[Any]:
    """FlashInfer's ``JitSpec`` of every kernel module the engine loads."""
    import torch
    from flashinfer.jit.activation import gen_act_and_mul_module
    from flashinfer.jit.attention import gen_batch_decode_module, gen_batch_prefill_module
    from flashinfer.jit.norm import gen_norm_module
    from flashinfer.jit.rope import gen_rope_module

    for name in DTYPES:
        dtype = getattr(torch, name)
        for head_dim in HEAD_DIMS:
            common = {
                "dtype_q": dtype,
                "dtype_kv": dtype,
                "dtype_o": dtype,
                "dtype_idx": torch.int32,
                "head_dim_qk": head_dim,
                "head_dim_vo": head_dim,
                "pos_encoding_mode": 0,  # RoPE is applied before attention
                "use_sliding_window": False,
                "use_logits_soft_cap": False,
            }
            yield gen_batch_decode_module(**common)
            yield gen_batch_prefill_module("fa2", **common, use_fp16_qk_reduction=False)
    yield gen_norm_module()
    yield gen_rope_module()
    yield gen_act_and_mul_module("silu")


def aot_dir() -> Path:
    from flashinfer.jit import env as jit_env

    return Path(jit_env.FLASHINFER_AOT_DIR)


def build() -> int:
    """Compile every module (ninja, in parallel) and copy each ``.so`` to the AOT directory."""
    from flashinfer.jit import env as jit_env
    from flashinfer.jit.core import build_jit_specs

    specs = list(engine_specs())
    start = time.perf_counter()
    archs = os.environ["FLASHINFER_CUDA_ARCH_LIST"]
    print(f"building {len(specs)} modules for {archs}", flush=True)
    build_jit_specs(specs, verbose=False, skip_prebuilt=False)
    out = aot_dir()
    for spec in specs:
        target = out / spec.name / f"{spec.name}.so"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path(jit_env.FLASHINFER_JIT_DIR) / spec.name / f"{spec.name}.so", target)
    size = sum(f.stat().st_size for f in out.rglob("*.so"))
    print(f"{len(specs)} modules, {size / 1e6:.0f} MB in {out}, "
          f"{time.perf_counter() - start:.0f} s", flush=True)  # fmt: skip
    return 0


def check() -> int:
    """Every module the engine loads comes from the AOT directory and loads."""
    from flashinfer.jit.core import MissingJITCacheError

    os.environ["FLASHINFER_DISABLE_JIT"] = "1"  # a missing module raises instead of compiling
    missing = []
    specs = list(engine_specs())
    for spec in specs:
        if not spec.is_aot:
            missing.append(spec.name)
            continue
        try:
            spec.build_and_load()
        except MissingJITCacheError:
            missing.append(spec.name)
    if missing:
        print(f"not in {aot_dir()}: {', '.join(missing)}", file=sys.stderr)
        return 1
    print(f"{len(specs)} FlashInfer modules load from {aot_dir()}")
    return 0


def main(argv: list[str]) -> int:
    if argv not in (["build"], ["check"]):
        print(__doc__, file=sys.stderr)
        return 2
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", DEFAULT_ARCHS)
    return build() if argv == ["build"] else check()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
