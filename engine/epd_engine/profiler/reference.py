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

Gemma-3-4B is scaled the same way (not measured): its SigLIP ViT (27 x 1152) runs 16
patches of an 896-px image per token (256 per image), ~4x Qwen3-VL's ViT work per token;
its decoder is ~4 B. Of its 34 layers 29 slide over a 1,024-token window: a KV migration
moves 5 x 4 KiB per token plus 29 x 4 KiB for the last 1,024 tokens only
(``MigrationCoeffs.kv_windowed_bytes_per_token``), while decode (torch attention, which
reads every page) is charged for all 34 layers' pages.
"""

from __future__ import annotations

from pathlib import Path

from epd_engine.profiler.cost_model import (
    Capacity,
    EncodeCoeffs,
    FittedCostModel,
    LanguageCoeffs,
    MigrationCoeffs,
    load_cost_model,
)
from epd_engine.profiler.links import LinkCoeffs
from epd_engine.profiler.rank_costs import RankCosts, RankedShape

REFERENCE_MODELS = ("llava-1.5-7b", "qwen3-vl-8b", "gemma3-4b")


def named_cost_model(name: str | Path) -> FittedCostModel:
    """``reference`` or ``reference:MODEL`` (a synthetic reference), else a cost model JSON
    file; ValueError naming what is wrong."""
    kind, _, model = str(name).partition(":")
    if kind == "reference":
        return reference_cost_model(model or "llava-1.5-7b")
    return load_cost_model(name)


def reference_cost_model(model: str = "llava-1.5-7b") -> FittedCostModel:
    """The synthetic reference of ``model`` (one of ``REFERENCE_MODELS``)."""
    if model == "qwen3-vl-8b":
        return _qwen3_vl_8b()
    if model == "gemma3-4b":
        return _gemma3_4b()
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
        # 32 heads, 32 KV heads, MLP 11,008: every size cuts it; 6.7 B language weights
        ranks=_ranks(RankedShape(32, 4096, 32064, 2), 13.5e9, (1, 2, 4, 8)),
        meta={
            "source": "synthetic reference (epd_engine.profiler.reference), not measured",
            "model": {"name": "llava-1.5-7b", "dtype": "float16"},
            "hardware": {"device": "H800-class GPU (assumed)"},
        },
    )


# The ranks of one instance all-reduce over NVLink within a node: NCCL's all-reduce on
# H100/H800 SXM reaches ~360 GB/s of bus bandwidth, with ~15 us a collective at the small
# sizes of a decode step (assumed from NVIDIA's published nccl-tests shapes, not measured).
NVLINK = LinkCoeffs(latency_s=15e-6, bytes_per_s=360e9)


def _ranks(shape: RankedShape, weight_bytes: float, sizes: tuple[int, ...]) -> RankCosts:
    return RankCosts(shape=shape, link=NVLINK, weight_bytes=int(weight_bytes), sizes=sizes)


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
        # 32 heads, 8 KV heads, MLP 12,288; ~8.2 B language weights
        ranks=_ranks(RankedShape(QWEN3_VL_8B_LAYERS, 4096, 151936, 2), 16.4e9, (1, 2, 4, 8)),
        meta={
            "source": "synthetic reference (epd_engine.profiler.reference), not measured",
            "model": {"name": "qwen3-vl-8b", "dtype": "bfloat16"},
            "hardware": {"device": "H800-class GPU (assumed)"},
        },
    )


# Gemma-3-4B's shapes (``gemma3_preset.GEMMA3_4B``; a test keeps them equal).
GEMMA3_4B_LAYERS, GEMMA3_4B_SLIDING, GEMMA3_4B_WINDOW = 34, 29, 1024
GEMMA3_4B_KV_HEADS, GEMMA3_4B_HEAD_DIM, GEMMA3_4B_HIDDEN = 4, 256, 2560


def _gemma3_4b() -> FittedCostModel:
    layer_bytes = 2 * GEMMA3_4B_KV_HEADS * GEMMA3_4B_HEAD_DIM * 2  # per token, bf16
    all_layers = GEMMA3_4B_LAYERS * layer_bytes
    return FittedCostModel(
        encode=EncodeCoeffs(fixed_s=0.006, per_token_s=64e-6, knee_tokens=4 * 256),
        language=LanguageCoeffs(
            fixed_s=0.007,
            per_token_s=55e-6,
            knee_tokens=64,
            per_kpair_s=1.5e-6,
            per_kcontext_s=1.7e-4 * all_layers / (512 * 1024),
            per_sample_s=5e-6,
        ),
        overlap=0.5,
        migration=MigrationCoeffs(
            latency_s=0.001,
            bytes_per_s=50e9,
            image_bytes_per_token=GEMMA3_4B_HIDDEN * 2,
            kv_bytes_per_token=(GEMMA3_4B_LAYERS - GEMMA3_4B_SLIDING) * layer_bytes,
            kv_windowed_bytes_per_token=GEMMA3_4B_SLIDING * layer_bytes,
            kv_window_tokens=GEMMA3_4B_WINDOW,
        ),
        capacity=Capacity(
            num_kv_blocks=28000,  # ~0.9 x (80 GB - 8.6 GB weights) / 136 KiB per token / 16
            kv_block_size=16,
            num_image_blocks=256,
            image_block_tokens=256,
            max_num_running=512,
            max_model_len=32768,
            tokens_per_image=256,  # every image, whatever its size
        ),
        # 8 heads, 4 KV heads, MLP 10,240: up to 4 ranks; ~3.9 B language weights
        ranks=_ranks(RankedShape(GEMMA3_4B_LAYERS, GEMMA3_4B_HIDDEN, 262208, 2), 7.8e9, (1, 2, 4)),
        meta={
            "source": "synthetic reference (epd_engine.profiler.reference), not measured",
            "model": {"name": "gemma3-4b", "dtype": "bfloat16"},
            "hardware": {"device": "H800-class GPU (assumed)"},
        },
    )
