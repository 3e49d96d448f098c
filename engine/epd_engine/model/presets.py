"""Model shapes `epdctl make-model` writes: HF config.json contents plus tokenizer sizes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


@dataclass(frozen=True)
class LlavaPreset:
    name: str
    text_config: dict[str, Any]  # LlamaConfig fields
    vision_config: dict[str, Any]  # CLIPVisionConfig fields
    base_vocab_size: int  # tokenizer tokens before <image>, <pad>: <image> gets this id
    default_dtype: str  # "float32" | "float16" | "bfloat16"

    @property
    def image_token_index(self) -> int:
        return self.base_vocab_size

    @property
    def pad_token_id(self) -> int:
        return self.base_vocab_size + 1

    @property
    def num_image_tokens(self) -> int:
        return (self.vision_config["image_size"] // self.vision_config["patch_size"]) ** 2

    def hf_config(self, dtype: str) -> dict[str, Any]:
        """``config.json`` in the layout of ``llava-hf/llava-1.5-7b-hf``."""
        return {
            "architectures": ["LlavaForConditionalGeneration"],
            "model_type": "llava",
            "image_token_index": self.image_token_index,
            "image_seq_length": self.num_image_tokens,
            "pad_token_id": self.pad_token_id,
            "projector_hidden_act": "gelu",
            "multimodal_projector_bias": True,
            "vision_feature_layer": -2,
            "vision_feature_select_strategy": "default",
            "tie_word_embeddings": False,
            "torch_dtype": dtype,
            "vocab_size": self.text_config["vocab_size"],
            "text_config": {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "torch_dtype": dtype,
                **self.text_config,
            },
            "vision_config": {"model_type": "clip_vision_model", **self.vision_config},
        }


_LLAMA_COMMON: dict[str, Any] = {
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}

TINY_LLAVA = LlavaPreset(
    name="tiny-llava",
    text_config={
        **_LLAMA_COMMON,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,  # GQA, as the engine must support it
        "max_position_embeddings": 2048,
        "vocab_size": 1002,  # 1000 BPE tokens + <image> + <pad>
        "pad_token_id": 1001,
    },
    vision_config={
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "image_size": 56,
        "patch_size": 14,  # (56 / 14)^2 = 16 image tokens
        "projection_dim": 32,
        "layer_norm_eps": 1e-5,
        "hidden_act": "quick_gelu",
    },
    base_vocab_size=1000,
    default_dtype="float32",
)

LLAVA_15_7B = LlavaPreset(
    name="llava-1.5-7b",
    text_config={
        **_LLAMA_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 4096,
        "vocab_size": 32064,  # as the hub: 32000 + <image> + <pad>, padded to 64
        "pad_token_id": 32001,
    },
    vision_config={  # CLIP ViT-L/14-336
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "image_size": 336,
        "patch_size": 14,
        "projection_dim": 768,
        "layer_norm_eps": 1e-5,
        "hidden_act": "quick_gelu",
    },
    base_vocab_size=32000,
    default_dtype="float16",
)

PRESETS: dict[str, LlavaPreset] = {p.name: p for p in (TINY_LLAVA, LLAVA_15_7B)}
