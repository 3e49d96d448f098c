"""Qwen2-VL shapes ``epdctl make-model`` writes: hub ``config.json`` and tensor list.

The layout is ``Qwen/Qwen2-VL-7B-Instruct``'s: text fields at the top level of the config,
``visual.*`` / ``model.*`` / ``lm_head.*`` tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from epd_engine.model.make_specs import LOGIT_SCALE, TensorSpec, linear, norm

# OpenAI CLIP statistics, as Qwen2-VL's image processor uses them.
IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]
SPECIAL_TOKENS = (  # appended after the trained vocabulary, in Qwen2's order (and ids)
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


@dataclass(frozen=True)
class Qwen2VLPreset:
    name: str
    text_config: dict[str, Any]  # Qwen2VLTextConfig fields (top level of config.json)
    vision_config: dict[str, Any]  # Qwen2VLVisionConfig fields
    base_vocab_size: int  # trained BPE tokens; the special tokens follow
    min_pixels: int
    max_pixels: int
    default_dtype: str
    model_type: str = "qwen2_vl"  # or "qwen2_5_vl"

    @property
    def windowed(self) -> bool:
        return self.model_type == "qwen2_5_vl"

    @property
    def architecture(self) -> str:
        if self.windowed:
            return "Qwen2_5_VLForConditionalGeneration"
        return "Qwen2VLForConditionalGeneration"

    @property
    def processor_class(self) -> str:
        return "Qwen2_5_VLProcessor" if self.windowed else "Qwen2VLProcessor"

    def token_id(self, token: str) -> int:
        return self.base_vocab_size + SPECIAL_TOKENS.index(token)

    @property
    def image_token_index(self) -> int:
        return self.token_id("<|image_pad|>")

    def hf_config(self, dtype: str) -> dict[str, Any]:
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "torch_dtype": dtype,
            **self.text_config,
            "bos_token_id": self.token_id("<|endoftext|>"),
            "eos_token_id": self.token_id("<|im_end|>"),
            "vision_start_token_id": self.token_id("<|vision_start|>"),
            "vision_end_token_id": self.token_id("<|vision_end|>"),
            "vision_token_id": self.token_id("<|vision_pad|>"),
            "image_token_id": self.image_token_index,
            "video_token_id": self.token_id("<|video_pad|>"),
            "vision_config": self._vision_config(),
        }

    def _vision_config(self) -> dict[str, Any]:
        width = self.text_config["hidden_size"]
        if self.windowed:  # hidden_size is the ViT's own width there
            return {**self.vision_config, "out_hidden_size": width}
        return {**self.vision_config, "hidden_size": width}

    @property
    def vision_width(self) -> int:
        key = "hidden_size" if self.windowed else "embed_dim"
        return int(self.vision_config[key])


def tensor_specs(preset: Qwen2VLPreset) -> list[TensorSpec]:
    """Every tensor of the hub checkpoint, in hub naming and a stable order."""
    vc, tc = preset.vision_config, preset.text_config
    e, p, t, c = preset.vision_width, vc["patch_size"], vc["temporal_patch_size"], vc["in_chans"]
    windowed = preset.windowed
    mlp_dim = int(vc["intermediate_size"]) if windowed else int(e * vc["mlp_ratio"])
    merged = e * vc["spatial_merge_size"] ** 2
    h, inter = tc["hidden_size"], tc["intermediate_size"]
    specs = [
        TensorSpec(
            "visual.patch_embed.proj.weight", (e, c, t, p, p), "normal", (c * t * p * p) ** -0.5
        )
    ]
    for i in range(vc["depth"]):
        base = f"visual.blocks.{i}"
        specs += norm(f"{base}.norm1", e, bias=not windowed)  # RMSNorm has no bias
        specs += norm(f"{base}.norm2", e, bias=not windowed)
        specs += linear(f"{base}.attn.qkv", 3 * e, e, bias=True)
        specs += linear(f"{base}.attn.proj", e, e, bias=True)
        if windowed:
            specs += linear(f"{base}.mlp.gate_proj", mlp_dim, e, bias=True)
            specs += linear(f"{base}.mlp.up_proj", mlp_dim, e, bias=True)
            specs += linear(f"{base}.mlp.down_proj", e, mlp_dim, bias=True)
        else:
            specs += linear(f"{base}.mlp.fc1", mlp_dim, e, bias=True)
            specs += linear(f"{base}.mlp.fc2", e, mlp_dim, bias=True)
    specs += norm("visual.merger.ln_q", e, bias=not windowed)
    specs += linear("visual.merger.mlp.0", merged, merged, bias=True)
    specs += linear("visual.merger.mlp.2", h, merged, bias=True)

    head_dim = h // tc["num_attention_heads"]
    kv_size = tc["num_key_value_heads"] * head_dim
    specs.append(TensorSpec("model.embed_tokens.weight", (tc["vocab_size"], h), "normal"))
    for i in range(tc["num_hidden_layers"]):
        base = f"model.layers.{i}"
        specs += linear(f"{base}.self_attn.q_proj", h, h, bias=True)
        specs += linear(f"{base}.self_attn.k_proj", kv_size, h, bias=True)
        specs += linear(f"{base}.self_attn.v_proj", kv_size, h, bias=True)
        specs += linear(f"{base}.self_attn.o_proj", h, h, bias=False)
        specs += linear(f"{base}.mlp.gate_proj", inter, h, bias=False)
        specs += linear(f"{base}.mlp.up_proj", inter, h, bias=False)
        specs += linear(f"{base}.mlp.down_proj", h, inter, bias=False)
        specs += norm(f"{base}.input_layernorm", h, bias=False)
        specs += norm(f"{base}.post_attention_layernorm", h, bias=False)
    specs += norm("model.norm", h, bias=False)
    if not tc.get("tie_word_embeddings", False):
        specs += linear("lm_head", tc["vocab_size"], h, bias=False, gain=LOGIT_SCALE)
    return specs


_QWEN2_COMMON: dict[str, Any] = {
    "hidden_act": "silu",
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": 32768,
    "max_window_layers": 28,
    "tie_word_embeddings": False,
    "use_cache": True,
}
_VISION_COMMON: dict[str, Any] = {
    "hidden_act": "quick_gelu",
    "in_channels": 3,
    "in_chans": 3,  # the hub config spells it both ways
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}

TINY_QWEN2_VL = Qwen2VLPreset(
    name="tiny-qwen2-vl",
    text_config={
        **_QWEN2_COMMON,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,  # GQA
        "max_position_embeddings": 4096,
        "max_window_layers": 2,
        "vocab_size": 1024,  # 1000 BPE + 14 special tokens, padded as the hub pads them
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},  # head_dim 16
    },
    vision_config={**_VISION_COMMON, "depth": 2, "embed_dim": 32, "mlp_ratio": 2, "num_heads": 2},
    base_vocab_size=1000,
    # 56x56 -> 4 tokens ... 448x448 -> 256 tokens: a spread of image costs on a CPU.
    min_pixels=56 * 56,
    max_pixels=448 * 448,
    default_dtype="float32",
)

# The released Qwen2-VL / Qwen2.5-VL processors' bounds (max_pixels 12,845,056 = 16,384 tokens)
# on tiny shapes: a 4000x3000 photo is 15,301 image tokens. The vision tower is one block of
# width 16, so encoding 61k patches (full attention) stays a few seconds on a CPU.
TINY_QWEN2_VL_12MP = Qwen2VLPreset(
    name="tiny-qwen2-vl-12mp",
    text_config={**TINY_QWEN2_VL.text_config, "max_position_embeddings": 32768},
    vision_config={**_VISION_COMMON, "depth": 1, "embed_dim": 16, "mlp_ratio": 2, "num_heads": 1},
    base_vocab_size=1000,
    min_pixels=56 * 56,
    max_pixels=28 * 28 * 16384,
    default_dtype="float32",
)

QWEN2_VL_7B = Qwen2VLPreset(
    name="qwen2-vl-7b",
    text_config={
        **_QWEN2_COMMON,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "vocab_size": 152064,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    },
    vision_config={
        **_VISION_COMMON,
        "depth": 32,
        "embed_dim": 1280,
        "mlp_ratio": 4,
        "num_heads": 16,
    },
    base_vocab_size=151643,
    min_pixels=56 * 56,
    max_pixels=28 * 28 * 16384,  # the release's preprocessor_config.json: 12.8 MP
    default_dtype="bfloat16",
)

_VISION_25: dict[str, Any] = {
    **_VISION_COMMON,
    "hidden_act": "silu",
    "window_size": 112,  # 8 x 8 patches = 4 x 4 merged tokens per window
    "tokens_per_second": 2,
}

TINY_QWEN2_5_VL = Qwen2VLPreset(
    name="tiny-qwen2.5-vl",
    text_config={
        **TINY_QWEN2_VL.text_config,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    },
    vision_config={
        **_VISION_25,
        "depth": 4,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "fullatt_block_indexes": [1, 3],
    },
    base_vocab_size=1000,
    min_pixels=56 * 56,
    max_pixels=448 * 448,
    default_dtype="float32",
    model_type="qwen2_5_vl",
)

QWEN2_5_VL_7B = Qwen2VLPreset(
    name="qwen2.5-vl-7b",
    text_config={
        **QWEN2_VL_7B.text_config,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    },
    vision_config={
        **_VISION_25,
        "depth": 32,
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "fullatt_block_indexes": [7, 15, 23, 31],
    },
    base_vocab_size=151643,
    min_pixels=56 * 56,
    max_pixels=28 * 28 * 16384,  # the release's preprocessor_config.json: 12.8 MP
    default_dtype="bfloat16",
    model_type="qwen2_5_vl",
)

QWEN2_VL_PRESETS: dict[str, Qwen2VLPreset] = {
    p.name: p
    for p in (TINY_QWEN2_VL, TINY_QWEN2_VL_12MP, QWEN2_VL_7B, TINY_QWEN2_5_VL, QWEN2_5_VL_7B)
}
