"""Parse a Hugging Face LLaVA ``config.json`` into the few numbers our model needs.

Missing fields take the same defaults as ``transformers`` (``LlavaConfig``,
``LlamaConfig``, ``CLIPVisionConfig``): the hub's ``llava-1.5-7b-hf`` config leaves most
text fields out and relies on them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ModelFormatError(ValueError):
    """A checkpoint directory we cannot load (missing file, wrong model type, bad tensors)."""


# Defaults of transformers' CLIPVisionConfig, with LlavaConfig's ViT-L/14-336 when absent.
_CLIP_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 32,
    "layer_norm_eps": 1e-5,
    "hidden_act": "quick_gelu",
}
_LLAVA_DEFAULT_VISION: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "image_size": 336,
    "patch_size": 14,
}
# Defaults of transformers' LlamaConfig.
_LLAMA_DEFAULTS: dict[str, Any] = {
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "vocab_size": 32000,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
}


@dataclass(frozen=True)
class VisionConfig:
    """CLIP vision tower, cut at ``feature_layer`` (LLaVA never runs the layers after it)."""

    image_size: int
    patch_size: int
    num_channels: int
    hidden_size: int
    intermediate_size: int
    num_layers: int  # layers in the checkpoint
    num_heads: int
    layer_norm_eps: float
    hidden_act: str  # "quick_gelu" | "gelu"
    feature_layer: int  # index into hidden_states (0 = embeddings), negative from the end
    keep_cls: bool  # vision_feature_select_strategy "full" keeps CLS, "default" drops it

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_layers_used(self) -> int:
        """Encoder layers run to reach ``hidden_states[feature_layer]``."""
        num_states = self.num_layers + 1
        return self.feature_layer % num_states


@dataclass(frozen=True)
class LlavaModelConfig:
    """LLaVA-1.5: a CLIP vision tower + 2-layer projector + a LLaMA decoder."""

    image_token_index: int
    num_image_tokens: int  # per image: (image_size // patch_size) ** 2, CLS dropped
    image_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    bos_token_id: int
    eos_token_id: int | list[int]
    pad_token_id: int | None
    rms_norm_eps: float
    rope_theta: float
    projector_hidden_act: str
    projector_bias: bool
    vision: VisionConfig
    torch_dtype: str | None  # dtype the checkpoint was saved in, if stated

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.eos_token_id
        return list(eos) if isinstance(eos, list) else [eos]

    @property
    def image_page_tokens(self) -> int:
        """Rows of an image-cache page: one image per page (every image has this many)."""
        return self.num_image_tokens

    uses_mrope = False  # positions are the KV slots

    @property
    def image_row_size(self) -> int:
        """Values per image token in the image cache: the embedding alone."""
        return self.hidden_size

    @property
    def fixed_image_tokens(self) -> int | None:
        """Tokens every image takes (the cost model charges images at it)."""
        return self.num_image_tokens

    @classmethod
    def from_dir(cls, model_dir: Path) -> LlavaModelConfig:
        raw, generation, source = read_hf_config(model_dir)
        return cls.from_dict(raw, generation=generation, source=source)

    @classmethod
    def from_dict(
        cls,
        raw: dict[str, Any],
        generation: dict[str, Any] | None = None,
        source: str = "config.json",
    ) -> LlavaModelConfig:
        if raw.get("model_type") != "llava":
            raise ModelFormatError(
                f"{source}: model_type is {raw.get('model_type')!r}, expected 'llava'"
            )
        text = {**_LLAMA_DEFAULTS, **(raw.get("text_config") or {})}
        if text.get("model_type", "llama") != "llama":
            raise ModelFormatError(f"{source}: text_config.model_type must be 'llama'")
        for flag in ("rope_scaling", "attention_bias", "mlp_bias"):
            if text.get(flag):
                raise ModelFormatError(f"{source}: text_config.{flag} is not supported")
        if text["hidden_act"] != "silu":
            raise ModelFormatError(f"{source}: text_config.hidden_act must be 'silu'")
        vision = _parse_vision(raw, source)
        num_heads = int(text["num_attention_heads"])
        hidden_size = int(text["hidden_size"])
        eos = (generation or {}).get("eos_token_id", text["eos_token_id"])
        num_image_tokens = vision.num_patches + (1 if vision.keep_cls else 0)
        return cls(
            image_token_index=int(raw.get("image_token_index", raw.get("image_token_id", 32000))),
            num_image_tokens=num_image_tokens,
            image_size=vision.image_size,
            hidden_size=hidden_size,
            intermediate_size=int(text["intermediate_size"]),
            num_layers=int(text["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(text.get("num_key_value_heads") or num_heads),
            head_dim=int(text.get("head_dim") or hidden_size // num_heads),
            vocab_size=int(text["vocab_size"]),
            max_position_embeddings=int(text["max_position_embeddings"]),
            bos_token_id=int(text["bos_token_id"]),
            eos_token_id=[int(e) for e in eos] if isinstance(eos, list) else int(eos),
            pad_token_id=raw.get("pad_token_id", text.get("pad_token_id")),
            rms_norm_eps=float(text["rms_norm_eps"]),
            rope_theta=float(text["rope_theta"]),
            projector_hidden_act=str(raw.get("projector_hidden_act", "gelu")),
            projector_bias=bool(raw.get("multimodal_projector_bias", True)),
            vision=vision,
            torch_dtype=raw.get("torch_dtype", raw.get("dtype")),
        )


def _parse_vision(raw: dict[str, Any], source: str) -> VisionConfig:
    given = raw.get("vision_config")
    vision = {**_CLIP_DEFAULTS, **(_LLAVA_DEFAULT_VISION if given is None else given)}
    if vision.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise ModelFormatError(f"{source}: vision_config.model_type must be 'clip_vision_model'")
    if vision["hidden_act"] not in ("quick_gelu", "gelu"):
        raise ModelFormatError(f"{source}: vision hidden_act {vision['hidden_act']!r} unsupported")
    feature_layer = raw.get("vision_feature_layer", -2)
    if not isinstance(feature_layer, int):
        raise ModelFormatError(f"{source}: only a single integer vision_feature_layer is supported")
    strategy = raw.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ModelFormatError(f"{source}: vision_feature_select_strategy {strategy!r} unknown")
    num_layers = int(vision["num_hidden_layers"])
    if not -(num_layers + 1) <= feature_layer <= num_layers:
        raise ModelFormatError(f"{source}: vision_feature_layer {feature_layer} out of range")
    return VisionConfig(
        image_size=int(vision["image_size"]),
        patch_size=int(vision["patch_size"]),
        num_channels=int(vision["num_channels"]),
        hidden_size=int(vision["hidden_size"]),
        intermediate_size=int(vision["intermediate_size"]),
        num_layers=num_layers,
        num_heads=int(vision["num_attention_heads"]),
        layer_norm_eps=float(vision["layer_norm_eps"]),
        hidden_act=str(vision["hidden_act"]),
        feature_layer=feature_layer,
        keep_cls=strategy == "full",
    )


def read_hf_config(model_dir: Path) -> tuple[dict[str, Any], dict[str, Any] | None, str]:
    """A checkpoint's ``config.json``, its ``generation_config.json`` (None when absent) and
    the config's path, for error messages: what every family's ``from_dir`` reads."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        raise ModelFormatError(f"{config_path} not found: not a Hugging Face model directory")
    generation_path = Path(model_dir) / "generation_config.json"
    generation = read_json(generation_path) if generation_path.is_file() else None
    return read_json(config_path), generation, str(config_path)


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path}: expected a JSON object")
    return data
