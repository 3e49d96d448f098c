"""Built-in, *synthetic* cost models: LLaVA-1.5-7B (fp16) and Qwen3-VL-8B (bf16) on one
H800-class GPU.

Not a measurement: coefficients are set from first principles and the published stage
behaviour so plans for GPU clusters can be explored before anyone profiles real hardware
(``epdctl plan --cost-model reference``). Anchors (REFERENCE-NUMBERS.md, HydraInfer):
encode saturates near 6 images (576 tokens each), prefill at batch 1 (~1k tokens), decode
near 512; 95% of KV migrations < 8 ms, image migrations < 2 ms. Arithmetic:

- language: ~10k prefill tokens/s for a 7B model in a serving engine (~90 us/token once
  compute bound, 1k-token prefill ~0.1 s); a weight read plus launch overheads -> ~8 ms
  floor per step; decode attention reads 512 KiB of KV per context token -> ~0.17 ms per
  1k context tokens (batch 256 at 700 tokens of context: ~60 ms per step).
- encode: CLIP ViT-L/336, ~15 ms for a batch of 6 images (~2.5 ms per image saturated).
- migration: 50 GB/s effective link, 1 ms handshake; KV 512 KiB/token, image 8 KiB/token.

Qwen3-VL-8B is scaled from it by FLOPs and bytes (not anchored on a measurement): its ViT
(27 x 1152, ~0.4 B) runs four 16-px patches per token, ~5x CLIP-L's work per token; its
decoder is ~8 B with GQA (8 of 32 heads), so 144 KiB of KV per token; an image token moves
its embedding and three DeepStack levels, 4 x 4096 x 2 B = 32 KiB (``image_row_size``).
"""

from __future__ import annotations

from epd_engine.profiler.cost_model import (
    Capacity,
    EncodeCoeffs,
    FittedCostModel,
    LanguageCoeffs,
    MigrationCoeffs,
)

REFERENCE_MODELS = ("llava-1.5-7b", "qwen3-vl-8b")


def reference_cost_model(model: str = "llava-1.5-7b") -> FittedCostModel:
    """The synthetic reference of ``model`` (one of ``REFERENCE_MODELS``)."""
    if model == "qwen3-vl-8b":
        return _qwen3_vl_8b()
    if model != "llava-1.5-7b":
        raise ValueError(
            f"no reference cost model for {model!r}; known: {', '.join(REFERENCE_MODELS)}"
        )
    return FittedCostModel(
        encode=EncodeCoeffs(fixed_s=0.005, per_token_s=3e-6, knee_tokens=6 * 576),
        language=LanguageCoeffs(
            fixed_s=0.008,
            per_token_s=90e-6,
            knee_tokens=64,
            per_kpair_s=2.0e-6,
            per_kcontext_s=1.7e-4,
            per_sample_s=5e-6,
        ),
        overlap=0.5,
        migration=MigrationCoeffs(
            latency_s=0.001,
            bytes_per_s=50e9,
            image_bytes_per_token=4096 * 2,
            kv_bytes_per_token=2 * 32 * 4096 * 2,
        ),
        capacity=Capacity(
            num_kv_blocks=6000,  # ~0.9 x (80 GB - 14 GB weights) / 512 KiB per token / 16
            kv_block_size=16,
            num_image_blocks=256,
            image_block_tokens=576,
            max_num_running=512,
            max_model_len=4096,
            tokens_per_image=None,  # trust the trace (recorded for this model)
        ),
        meta={
            "source": "synthetic reference (epd_engine.profiler.reference), not measured",
            "model": {"name": "llava-1.5-7b", "dtype": "float16"},
            "hardware": {"device": "H800-class GPU (assumed)"},
        },
    )


# Qwen3-VL-8B's shapes (``qwen3_vl_preset.QWEN3_VL_8B``; a test keeps them equal).
QWEN3_VL_8B_LAYERS, QWEN3_VL_8B_KV_HEADS, QWEN3_VL_8B_HEAD_DIM = 36, 8, 128
QWEN3_VL_8B_IMAGE_ROW = 4 * 4096  # the embedding + three DeepStack levels


def _qwen3_vl_8b() -> FittedCostModel:
    kv_bytes_per_token = 2 * QWEN3_VL_8B_LAYERS * QWEN3_VL_8B_KV_HEADS * QWEN3_VL_8B_HEAD_DIM * 2
    return FittedCostModel(
        encode=EncodeCoeffs(fixed_s=0.006, per_token_s=16e-6, knee_tokens=4 * 256),
        language=LanguageCoeffs(
            fixed_s=0.009,
            per_token_s=100e-6,
            knee_tokens=64,
            per_kpair_s=2.0e-6,
            per_kcontext_s=1.7e-4 * kv_bytes_per_token / (512 * 1024),
            per_sample_s=5e-6,
        ),
        overlap=0.5,
        migration=MigrationCoeffs(
            latency_s=0.001,
            bytes_per_s=50e9,
            image_bytes_per_token=QWEN3_VL_8B_IMAGE_ROW * 2,
            kv_bytes_per_token=kv_bytes_per_token,
        ),
        capacity=Capacity(
            num_kv_blocks=23000,  # ~0.9 x (80 GB - 17.5 GB weights) / 144 KiB per token / 16
            kv_block_size=16,
            num_image_blocks=256,
            image_block_tokens=64,
            max_num_running=512,
            max_model_len=32768,
            tokens_per_image=None,  # by resolution: the trace's per-image tokens
        ),
        meta={
            "source": "synthetic reference (epd_engine.profiler.reference), not measured",
            "model": {"name": "qwen3-vl-8b", "dtype": "bfloat16"},
            "hardware": {"device": "H800-class GPU (assumed)"},
        },
    )
