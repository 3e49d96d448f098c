"""Gemma 3 shapes ``epdctl make-model`` writes: hub ``config.json`` and tensor list.

The layout is ``google/gemma-3-4b-it``'s: ``text_config`` and ``vision_config`` nested,
tensors named ``language_model.model.*`` / ``vision_tower.vision_model.*`` /
``multi_modal_projector.*``, no ``lm_head`` (tied to the embeddings). Special tokens follow
the trained BPE; ``gemma3-4b`` puts ``<image_soft_token>`` at the release's id 262144.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from epd_engine.model.make_specs import TensorSpec, linear, norm

# Embeddings are scaled by sqrt(hidden) and are also the (tied) LM head: larger, a token's
# own embedding dominates the residual stream and greedy decoding repeats the last token.
EMBED_STD = 0.15
IMAGE_MEAN = [0.5, 0.5, 0.5]
IMAGE_STD = [0.5, 0.5, 0.5]
SPECIAL_TOKENS = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
)


@dataclass(frozen=True)
class Gemma3Preset:
    name: str
    text_config: dict[str, Any]  # Gemma3TextConfig fields
    vision_config: dict[str, Any]  # SiglipVisionConfig fields
    mm_tokens_per_image: int
    sliding_window_pattern: int  # every n-th layer global, the others sliding
    base_vocab_size: int  # trained BPE tokens; the special tokens follow
    default_dtype: str
    architecture = "Gemma3ForConditionalGeneration"
    processor_class = "Gemma3Processor"
    special_tokens = SPECIAL_TOKENS

    def token_id(self, token: str) -> int:
        return self.base_vocab_size + SPECIAL_TOKENS.index(token)

    @property
    def image_token_index(self) -> int:
        return self.token_id("<image_soft_token>")

    @property
    def layer_types(self) -> list[str]:
        pattern = self.sliding_window_pattern
        return [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(self.text_config["num_hidden_layers"])
        ]

    def hf_config(self, dtype: str) -> dict[str, Any]:
        return {
            "architectures": [self.architecture],
            "model_type": "gemma3",
            "boi_token_index": self.token_id("<start_of_image>"),
            "eoi_token_index": self.token_id("<end_of_image>"),
            "image_token_index": self.image_token_index,
            "mm_tokens_per_image": self.mm_tokens_per_image,
            "torch_dtype": dtype,
            "text_config": {
                "model_type": "gemma3_text",
                "torch_dtype": dtype,
                **self.text_config,
                "layer_types": self.layer_types,
                "bos_token_id": self.token_id("<bos>"),
                "eos_token_id": self.token_id("<eos>"),
                "pad_token_id": self.token_id("<pad>"),
            },
            "vision_config": {
                "model_type": "siglip_vision_model",
                "vision_use_head": False,
                **self.vision_config,
            },
        }


def tensor_specs(preset: Gemma3Preset) -> list[TensorSpec]:
    """Every tensor of the hub checkpoint, in hub naming and a stable order."""
    vc, tc = preset.vision_config, preset.text_config
    hv, p, c = vc["hidden_size"], vc["patch_size"], vc.get("num_channels", 3)
    vit = "vision_tower.vision_model"
    specs = [
        TensorSpec(
            f"{vit}.embeddings.patch_embedding.weight", (hv, c, p, p), "normal", (c * p * p) ** -0.5
        ),
        TensorSpec(f"{vit}.embeddings.patch_embedding.bias", (hv,), "bias"),
        TensorSpec(
            f"{vit}.embeddings.position_embedding.weight",
            ((vc["image_size"] // p) ** 2, hv),
            "normal",
            0.5,
        ),
    ]
    for i in range(vc["num_hidden_layers"]):
        base = f"{vit}.encoder.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            specs += linear(f"{base}.self_attn.{proj}", hv, hv, bias=True)
        specs += norm(f"{base}.layer_norm1", hv, bias=True)
        specs += linear(f"{base}.mlp.fc1", vc["intermediate_size"], hv, bias=True)
        specs += linear(f"{base}.mlp.fc2", hv, vc["intermediate_size"], bias=True)
        specs += norm(f"{base}.layer_norm2", hv, bias=True)
    specs += norm(f"{vit}.post_layernorm", hv, bias=True)
    h, inter, head_dim = tc["hidden_size"], tc["intermediate_size"], tc["head_dim"]
    specs += norm("multi_modal_projector.mm_soft_emb_norm", hv, bias=False)
    specs.append(
        TensorSpec("multi_modal_projector.mm_input_projection_weight", (hv, h), "normal", hv**-0.5)
    )
    lm = "language_model.model"
    q_size, kv_size = tc["num_attention_heads"] * head_dim, tc["num_key_value_heads"] * head_dim
    specs.append(
        TensorSpec(f"{lm}.embed_tokens.weight", (tc["vocab_size"], h), "normal", EMBED_STD)
    )
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
        for name in ("input_layernorm", "post_attention_layernorm",
                     "pre_feedforward_layernorm", "post_feedforward_layernorm"):  # fmt: skip
            specs += norm(f"{base}.{name}", h, bias=False)
    specs += norm(f"{lm}.norm", h, bias=False)
    return specs


_TEXT_COMMON: dict[str, Any] = {
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},  # as the 4B release
    "attention_bias": False,
    "attention_dropout": 0.0,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "initializer_range": 0.02,
    "use_cache": True,
}
_VISION_COMMON: dict[str, Any] = {
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
    "num_channels": 3,
    "attention_dropout": 0.0,
}

TINY_GEMMA3 = Gemma3Preset(
    name="tiny-gemma3",
    text_config={
        **_TEXT_COMMON,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,  # sliding, global, sliding, global
        "num_attention_heads": 4,
        "num_key_value_heads": 2,  # GQA
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 16,  # shorter than a prompt with an image: the window matters
        "max_position_embeddings": 4096,
        "vocab_size": 1024,  # 1000 BPE + 9 special tokens, padded to a multiple of 64
    },
    vision_config={
        **_VISION_COMMON,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 64,
        "patch_size": 8,  # 8 x 8 patches, pooled 2 x 2 -> 16 tokens per image
    },
    mm_tokens_per_image=16,
    sliding_window_pattern=2,
    base_vocab_size=1000,
    default_dtype="float32",
)

GEMMA3_4B = Gemma3Preset(
    name="gemma3-4b",
    text_config={
        **_TEXT_COMMON,
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 34,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 1024,
        "max_position_embeddings": 131072,
        "vocab_size": 262208,
    },
    vision_config={  # SigLIP So400m/14 at 896 px
        **_VISION_COMMON,
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "image_size": 896,
        "patch_size": 14,
    },
    mm_tokens_per_image=256,
    sliding_window_pattern=6,
    base_vocab_size=262144 - SPECIAL_TOKENS.index("<image_soft_token>"),
    default_dtype="bfloat16",
)

GEMMA3_PRESETS: dict[str, Gemma3Preset] = {p.name: p for p in (TINY_GEMMA3, GEMMA3_4B)}
