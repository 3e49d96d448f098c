"""Qwen3-VL shapes ``epdctl make-model`` writes: hub ``config.json`` and tensor list.

The layout is ``Qwen/Qwen3-VL-8B-Instruct``'s: ``text_config`` and ``vision_config`` nested,
tensors named ``model.visual.*`` / ``model.language_model.*`` / ``lm_head.*`` (the layout
transformers 4.57 saves, which the release uses).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from epd_engine.model.make_specs import LOGIT_SCALE, TensorSpec, linear, norm
from epd_engine.model.qwen2_vl_preset import SPECIAL_TOKENS as QWEN2_SPECIAL_TOKENS

IMAGE_MEAN = [0.5, 0.5, 0.5]
IMAGE_STD = [0.5, 0.5, 0.5]
SPECIAL_TOKENS = (  # Qwen2-VL's, then Qwen3's tool and thinking tokens (ids as released)
    *QWEN2_SPECIAL_TOKENS,
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)


@dataclass(frozen=True)
class Qwen3VLPreset:
    name: str
    text_config: dict[str, Any]  # Qwen3VLTextConfig fields
    vision_config: dict[str, Any]  # Qwen3VLVisionConfig fields (out_hidden_size added)
    base_vocab_size: int  # trained BPE tokens; the special tokens follow
    min_pixels: int
    max_pixels: int
    default_dtype: str
    tie_word_embeddings: bool = False
    architecture = "Qwen3VLForConditionalGeneration"
    processor_class = "Qwen3VLProcessor"
    special_tokens = SPECIAL_TOKENS

    def token_id(self, token: str) -> int:
        return self.base_vocab_size + SPECIAL_TOKENS.index(token)

    @property
    def image_token_index(self) -> int:
        return self.token_id("<|image_pad|>")

    def hf_config(self, dtype: str) -> dict[str, Any]:
        return {
            "architectures": [self.architecture],
            "model_type": "qwen3_vl",
            "image_token_id": self.image_token_index,
            "video_token_id": self.token_id("<|video_pad|>"),
            "vision_start_token_id": self.token_id("<|vision_start|>"),
            "vision_end_token_id": self.token_id("<|vision_end|>"),
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": dtype,
            "text_config": {
                "model_type": "qwen3_vl_text",
                "dtype": dtype,
                **self.text_config,
                "bos_token_id": self.token_id("<|endoftext|>"),
                "eos_token_id": self.token_id("<|im_end|>"),
                "tie_word_embeddings": self.tie_word_embeddings,
            },
            "vision_config": {
                "model_type": "qwen3_vl",
                **self.vision_config,
                "out_hidden_size": self.text_config["hidden_size"],
            },
        }


def tensor_specs(preset: Qwen3VLPreset) -> list[TensorSpec]:
    """Every tensor of the hub checkpoint, in hub naming and a stable order."""
    vc, tc = preset.vision_config, preset.text_config
    e, p, t, c = vc["hidden_size"], vc["patch_size"], vc["temporal_patch_size"], vc["in_channels"]
    merged = e * vc["spatial_merge_size"] ** 2
    h, inter, head_dim = tc["hidden_size"], tc["intermediate_size"], tc["head_dim"]
    visual = "model.visual"
    patch_std = (c * t * p * p) ** -0.5
    specs = [
        TensorSpec(f"{visual}.patch_embed.proj.weight", (e, c, t, p, p), "normal", patch_std),
        TensorSpec(f"{visual}.patch_embed.proj.bias", (e,), "bias"),
        TensorSpec(f"{visual}.pos_embed.weight", (vc["num_position_embeddings"], e), "normal", 0.5),
    ]
    for i in range(vc["depth"]):
        base = f"{visual}.blocks.{i}"
        specs += norm(f"{base}.norm1", e, bias=True)
        specs += norm(f"{base}.norm2", e, bias=True)
        specs += linear(f"{base}.attn.qkv", 3 * e, e, bias=True)
        specs += linear(f"{base}.attn.proj", e, e, bias=True)
        specs += linear(f"{base}.mlp.linear_fc1", vc["intermediate_size"], e, bias=True)
        specs += linear(f"{base}.mlp.linear_fc2", e, vc["intermediate_size"], bias=True)
    mergers = [f"{visual}.merger"]
    mergers += [
        f"{visual}.deepstack_merger_list.{k}" for k in range(len(vc["deepstack_visual_indexes"]))
    ]
    for k, merger in enumerate(mergers):
        specs += norm(f"{merger}.norm", merged if k else e, bias=True)  # DeepStack: post-shuffle
        specs += linear(f"{merger}.linear_fc1", merged, merged, bias=True)
        specs += linear(f"{merger}.linear_fc2", h, merged, bias=True)

    lm = "model.language_model"
    q_size, kv_size = tc["num_attention_heads"] * head_dim, tc["num_key_value_heads"] * head_dim
    specs.append(TensorSpec(f"{lm}.embed_tokens.weight", (tc["vocab_size"], h), "normal"))
    for i in range(tc["num_hidden_layers"]):
        base = f"{lm}.layers.{i}"
        specs += linear(f"{base}.self_attn.q_proj", q_size, h, bias=False)
        specs += linear(f"{base}.self_attn.k_proj", kv_size, h, bias=False)
        specs += linear(f"{base}.self_attn.v_proj", kv_size, h, bias=False)
        specs += linear(f"{base}.self_attn.o_proj", h, q_size, bias=False)
        specs += norm(f"{base}.self_attn.q_norm", head_dim, bias=False)
        specs += norm(f"{base}.self_attn.k_norm", head_dim, bias=False)
        specs += linear(f"{base}.mlp.gate_proj", inter, h, bias=False)
        specs += linear(f"{base}.mlp.up_proj", inter, h, bias=False)
        specs += linear(f"{base}.mlp.down_proj", h, inter, bias=False)
        specs += norm(f"{base}.input_layernorm", h, bias=False)
        specs += norm(f"{base}.post_attention_layernorm", h, bias=False)
    specs += norm(f"{lm}.norm", h, bias=False)
    if not preset.tie_word_embeddings:
        specs += linear("lm_head", tc["vocab_size"], h, bias=False, gain=LOGIT_SCALE)
    return specs


_TEXT_COMMON: dict[str, Any] = {
    "hidden_act": "silu",
    "rope_theta": 5000000.0,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "use_cache": True,
}
_VISION_COMMON: dict[str, Any] = {
    "hidden_act": "gelu_pytorch_tanh",
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "initializer_range": 0.02,
}

TINY_QWEN3_VL = Qwen3VLPreset(
    name="tiny-qwen3-vl",
    text_config={
        **_TEXT_COMMON,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,  # more than the DeepStack levels: a layer without one too
        "num_attention_heads": 4,
        "num_key_value_heads": 2,  # GQA
        "head_dim": 16,
        "max_position_embeddings": 4096,
        "vocab_size": 1088,  # 1000 BPE + 26 special tokens, padded to a multiple of 64
        # 8 rotary pairs, interleaved: t h w t h w t t
        "rope_scaling": {
            "rope_type": "default",
            "mrope_interleaved": True,
            "mrope_section": [4, 2, 2],
        },
    },
    vision_config={
        **_VISION_COMMON,
        "depth": 4,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "num_position_embeddings": 64,  # an 8 x 8 grid, interpolated to each image's
        "deepstack_visual_indexes": [0, 1, 2],  # three levels, as the released models
    },
    base_vocab_size=1000,
    # 64x64 -> 4 tokens ... 512x512 -> 256 tokens (one token per 32x32 pixels).
    min_pixels=64 * 64,
    max_pixels=512 * 512,
    default_dtype="float32",
)

QWEN3_VL_8B = Qwen3VLPreset(
    name="qwen3-vl-8b",
    text_config={
        **_TEXT_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 262144,
        "vocab_size": 151936,
        "rope_scaling": {
            "rope_type": "default",
            "mrope_interleaved": True,
            "mrope_section": [24, 20, 20],
        },
    },
    vision_config={
        **_VISION_COMMON,
        "depth": 27,
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [8, 16, 24],
    },
    base_vocab_size=151643,
    min_pixels=65536,  # the release's size.shortest_edge / longest_edge
    max_pixels=16777216,
    default_dtype="bfloat16",
)

QWEN3_VL_PRESETS: dict[str, Qwen3VLPreset] = {p.name: p for p in (TINY_QWEN3_VL, QWEN3_VL_8B)}
