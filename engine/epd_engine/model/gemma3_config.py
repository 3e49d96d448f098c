"""Parse a Hugging Face Gemma 3 ``config.json`` into the numbers our model needs.

The hub's ``google/gemma-3-4b-it`` nests the decoder under ``text_config`` and the SigLIP
ViT under ``vision_config``; missing fields take the defaults of transformers'
``Gemma3TextConfig`` / ``SiglipVisionConfig`` / ``Gemma3Config``.

What matters for serving: every image becomes ``mm_tokens_per_image`` tokens (the ViT's
patch grid average-pooled), image tokens attend to each other both ways in the prefill,
and decoder layers are either sliding-window (``sliding_window`` most recent positions,
rotary base ``rope_local_base_freq``) or global (``rope_theta``, ``rope_scaling``):
``layer_windows`` says which, per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epd_engine.model.model_config import ModelFormatError, read_hf_config

_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
}
_VISION_DEFAULTS: dict[str, Any] = {  # SiglipVisionConfig's
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}


@dataclass(frozen=True)
class SiglipConfig:
    """The SigLIP ViT: conv patches (with bias) + learned positions, pre-LN blocks, final LN."""

    image_size: int
    patch_size: int
    num_channels: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_norm_eps: float
    hidden_act: str

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


@dataclass(frozen=True)
class Gemma3ModelConfig:
    """Gemma 3: SigLIP + pooled projector + a decoder of sliding-window and global layers."""

    image_token_index: int  # <image_soft_token>
    boi_token_index: int  # <start_of_image>
    eoi_token_index: int  # <end_of_image>
    num_image_tokens: int  # mm_tokens_per_image: every image, whatever its size
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_id: int | list[int]
    pad_token_id: int | None
    rms_norm_eps: float
    rope_theta: float  # global layers
    rope_scaling_factor: float  # global layers' linear position scaling (1: none)
    rope_local_theta: float  # sliding layers (never scaled)
    query_pre_attn_scalar: float
    # per layer: the positions a query sees back (itself included), None for a global layer
    layer_windows: tuple[int | None, ...]
    tie_word_embeddings: bool
    vision: SiglipConfig
    torch_dtype: str | None

    uses_mrope = False  # positions are the KV slots
    image_attention_bidirectional = True  # an image's tokens see each other in the prefill

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.eos_token_id
        return list(eos) if isinstance(eos, list) else [eos]

    @property
    def image_page_tokens(self) -> int:
        """Rows of an image-cache page: one image per page (every image has this many)."""
        return self.num_image_tokens

    @property
    def image_row_size(self) -> int:
        return self.hidden_size

    @property
    def fixed_image_tokens(self) -> int:
        return self.num_image_tokens

    @property
    def sliding_window(self) -> int | None:
        """The sliding layers' window (they share one), None when every layer is global."""
        return next((w for w in self.layer_windows if w is not None), None)

    @classmethod
    def from_dir(cls, model_dir: Path) -> Gemma3ModelConfig:
        return cls.from_dict(*read_hf_config(model_dir))

    @classmethod
    def from_dict(
        cls,
        raw: dict[str, Any],
        generation: dict[str, Any] | None = None,
        source: str = "config.json",
    ) -> Gemma3ModelConfig:
        if raw.get("model_type") != "gemma3":
            raise ModelFormatError(
                f"{source}: model_type is {raw.get('model_type')!r}, expected 'gemma3'"
            )
        text = {**_TEXT_DEFAULTS, **(raw.get("text_config") or {})}
        if text["hidden_activation"] != "gelu_pytorch_tanh":
            raise ModelFormatError(f"{source}: text_config.hidden_activation unsupported")
        for flag in ("attention_bias", "use_bidirectional_attention", "final_logit_softcapping",
                     "attn_logit_softcapping"):  # fmt: skip
            if text.get(flag):
                raise ModelFormatError(f"{source}: text_config.{flag} is not supported")
        num_layers = int(text["num_hidden_layers"])
        hidden = int(text["hidden_size"])
        vision = _parse_vision({**_VISION_DEFAULTS, **(raw.get("vision_config") or {})}, source)
        tokens = int(raw.get("mm_tokens_per_image", 256))
        side = int(tokens**0.5)
        if side * side != tokens or vision.patches_per_side % side:
            raise ModelFormatError(
                f"{source}: mm_tokens_per_image {tokens} must be a square whose side divides "
                f"the {vision.patches_per_side} patches per side"
            )
        eos = (generation or {}).get("eos_token_id", text["eos_token_id"])
        bos = text.get("bos_token_id")
        num_heads = int(text["num_attention_heads"])
        return cls(
            image_token_index=int(raw.get("image_token_index", raw.get("image_token_id", 262144))),
            boi_token_index=int(raw.get("boi_token_index", 255999)),
            eoi_token_index=int(raw.get("eoi_token_index", 256000)),
            num_image_tokens=tokens,
            hidden_size=hidden,
            intermediate_size=int(text["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(text.get("num_key_value_heads") or num_heads),
            head_dim=int(text.get("head_dim") or hidden // num_heads),
            vocab_size=int(text["vocab_size"]),
            max_position_embeddings=int(text["max_position_embeddings"]),
            bos_token_id=None if bos is None else int(bos),
            eos_token_id=[int(e) for e in eos] if isinstance(eos, list) else int(eos),
            pad_token_id=text.get("pad_token_id"),
            rms_norm_eps=float(text["rms_norm_eps"]),
            rope_theta=float(text["rope_theta"]),
            rope_scaling_factor=_rope_scaling_factor(text.get("rope_scaling"), source),
            rope_local_theta=float(text["rope_local_base_freq"]),
            query_pre_attn_scalar=float(text["query_pre_attn_scalar"]),
            layer_windows=_layer_windows(text, num_layers, source),
            tie_word_embeddings=bool(
                raw.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
            ),
            vision=vision,
            torch_dtype=raw.get("torch_dtype", raw.get("dtype", text.get("dtype"))),
        )


def _layer_windows(text: dict[str, Any], num_layers: int, source: str) -> tuple[int | None, ...]:
    """``layer_types`` (transformers >= 4.53) or, in older configs such as the release's,
    ``sliding_window_pattern``: every ``pattern``-th layer global, the others sliding."""
    types = text.get("layer_types")
    if types is None:
        pattern = int(text["sliding_window_pattern"])
        types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    if len(types) != num_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ModelFormatError(
            f"{source}: layer_types must give 'sliding_attention' or 'full_attention' "
            f"for each of the {num_layers} layers"
        )
    window = int(text["sliding_window"])
    if window < 1:
        raise ModelFormatError(f"{source}: sliding_window must be positive")
    return tuple(window if kind == "sliding_attention" else None for kind in types)


def _rope_scaling_factor(scaling: dict[str, Any] | None, source: str) -> float:
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return 1.0
    if kind == "linear":
        return float(scaling["factor"])  # type: ignore[index]
    raise ModelFormatError(f"{source}: rope_scaling type {kind!r} is not supported")


def _parse_vision(vision: dict[str, Any], source: str) -> SiglipConfig:
    if vision.get("model_type", "siglip_vision_model") != "siglip_vision_model":
        raise ModelFormatError(f"{source}: vision_config.model_type must be 'siglip_vision_model'")
    if vision["hidden_act"] != "gelu_pytorch_tanh":
        raise ModelFormatError(f"{source}: vision hidden_act {vision['hidden_act']!r} unsupported")
    return SiglipConfig(
        image_size=int(vision["image_size"]),
        patch_size=int(vision["patch_size"]),
        num_channels=int(vision["num_channels"]),
        hidden_size=int(vision["hidden_size"]),
        intermediate_size=int(vision["intermediate_size"]),
        num_layers=int(vision["num_hidden_layers"]),
        num_heads=int(vision["num_attention_heads"]),
        layer_norm_eps=float(vision["layer_norm_eps"]),
        hidden_act=str(vision["hidden_act"]),
    )
