"""Parse a Hugging Face Qwen2-VL ``config.json`` into the numbers our model needs.

The hub's ``Qwen/Qwen2-VL-7B-Instruct`` keeps the text fields at the top level (newer
transformers may save them under ``text_config``); both are read. Missing fields take the
defaults of transformers' ``Qwen2VLConfig`` / ``Qwen2VLTextConfig`` / ``Qwen2VLVisionConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epd_engine.model.model_config import ModelFormatError, read_hf_config

IMAGE_PAGE_TOKENS = 64  # a 448x448 image (256 tokens) takes 4 pages
_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 152064,
    "hidden_size": 8192,
    "intermediate_size": 29568,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
_VISION_DEFAULTS: dict[str, Any] = {
    "depth": 32,
    "embed_dim": 1280,
    "hidden_size": 3584,
    "hidden_act": "quick_gelu",
    "mlp_ratio": 4,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}


_VISION_25_DEFAULTS: dict[str, Any] = {  # Qwen2.5-VL: hidden_size is the ViT width there
    "depth": 32,
    "hidden_size": 1280,
    "out_hidden_size": 3584,
    "hidden_act": "silu",
    "intermediate_size": 3420,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31],
}
MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


@dataclass(frozen=True)
class Qwen2VisionConfig:
    """The variable-resolution ViT: patch embed, ``depth`` blocks with 2-D rotary, merger.

    Qwen2.5-VL (``windowed``): RMSNorm and SwiGLU (with biases) blocks; all blocks but
    ``fullatt_blocks`` attend within windows of ``window_size`` pixels.
    """

    depth: int
    embed_dim: int
    out_hidden_size: int  # the merger's output width: the text hidden size
    hidden_act: str
    mlp_hidden_dim: int
    num_heads: int
    in_channels: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    windowed: bool = False
    window_size: int = 0  # pixels
    fullatt_blocks: tuple[int, ...] = ()

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch as the image processor emits them."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclass(frozen=True)
class Qwen2VLModelConfig:
    """Qwen2-VL: the ViT above + a Qwen2 decoder (qkv bias) with multimodal RoPE."""

    image_token_index: int  # <|image_pad|>
    vision_start_token_id: int
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
    rope_theta: float
    mrope_section: tuple[int, int, int]  # rotary pairs given to the t, h, w streams
    tie_word_embeddings: bool
    vision: Qwen2VisionConfig
    torch_dtype: str | None
    # a deployment's lower bound on resized images (``--processor-max-pixels``); None: the
    # checkpoint's preprocessor_config.json (model/image_bounds.py)
    processor_max_pixels: int | None = None

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.eos_token_id
        return list(eos) if isinstance(eos, list) else [eos]

    @property
    def image_page_tokens(self) -> int:
        """Rows of an image-cache page; an image of more tokens spans several pages."""
        return IMAGE_PAGE_TOKENS

    uses_mrope = True  # three position streams, decoupled from the KV slots

    @property
    def image_row_size(self) -> int:
        """Values per image token in the image cache: the embedding alone."""
        return self.hidden_size

    fixed_image_tokens = None  # by resolution: the cost model reads each image's from the trace

    @property
    def merge_unit(self) -> int:
        """Patches merged into one LLM token (``spatial_merge_size ** 2``)."""
        return self.vision.spatial_merge_size**2

    @classmethod
    def from_dir(cls, model_dir: Path) -> Qwen2VLModelConfig:
        return cls.from_dict(*read_hf_config(model_dir))

    @classmethod
    def from_dict(
        cls,
        raw: dict[str, Any],
        generation: dict[str, Any] | None = None,
        source: str = "config.json",
    ) -> Qwen2VLModelConfig:
        model_type = raw.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ModelFormatError(
                f"{source}: model_type is {model_type!r}, expected one of {', '.join(MODEL_TYPES)}"
            )
        text = {**_TEXT_DEFAULTS, **raw, **(raw.get("text_config") or {})}
        if text.get("use_sliding_window"):
            raise ModelFormatError(f"{source}: use_sliding_window is not supported")
        if text["hidden_act"] != "silu":
            raise ModelFormatError(f"{source}: hidden_act must be 'silu'")
        rope = text.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", "mrope"):
            raise ModelFormatError(f"{source}: rope_scaling type {rope!r} is not supported")
        section = rope.get("mrope_section")
        num_heads, hidden = int(text["num_attention_heads"]), int(text["hidden_size"])
        head_dim = hidden // num_heads
        if not (isinstance(section, list) and len(section) == 3 and sum(section) == head_dim // 2):
            raise ModelFormatError(
                f"{source}: rope_scaling.mrope_section must be three ints summing to "
                f"head_dim / 2 = {head_dim // 2}, got {section!r}"
            )
        given_vision = raw.get("vision_config") or {}
        if model_type == "qwen2_5_vl":
            vision = _parse_vision_25({**_VISION_25_DEFAULTS, **given_vision}, source)
        else:
            vision = _parse_vision({**_VISION_DEFAULTS, **given_vision}, source)
        if vision.out_hidden_size != hidden:
            raise ModelFormatError(
                f"{source}: vision_config.hidden_size {vision.out_hidden_size} "
                f"!= hidden_size {hidden}"
            )
        eos = (generation or {}).get("eos_token_id", text["eos_token_id"])
        bos = text.get("bos_token_id")
        return cls(
            image_token_index=int(raw.get("image_token_id", 151655)),
            vision_start_token_id=int(raw.get("vision_start_token_id", 151652)),
            hidden_size=hidden,
            intermediate_size=int(text["intermediate_size"]),
            num_layers=int(text["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(text.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            vocab_size=int(text["vocab_size"]),
            max_position_embeddings=int(text["max_position_embeddings"]),
            bos_token_id=None if bos is None else int(bos),
            eos_token_id=[int(e) for e in eos] if isinstance(eos, list) else int(eos),
            pad_token_id=text.get("pad_token_id"),
            rms_norm_eps=float(text["rms_norm_eps"]),
            rope_theta=float(text["rope_theta"]),
            mrope_section=(int(section[0]), int(section[1]), int(section[2])),
            tie_word_embeddings=bool(text["tie_word_embeddings"]),
            vision=vision,
            torch_dtype=raw.get("torch_dtype", raw.get("dtype")),
        )


def _parse_vision(vision: dict[str, Any], source: str) -> Qwen2VisionConfig:
    if vision["hidden_act"] not in ("quick_gelu", "gelu"):
        raise ModelFormatError(f"{source}: vision hidden_act {vision['hidden_act']!r} unsupported")
    embed_dim = int(vision["embed_dim"])
    num_heads = int(vision["num_heads"])
    if embed_dim % num_heads or (embed_dim // num_heads) % 4:
        raise ModelFormatError(f"{source}: vision head_dim must be a multiple of 4")
    return Qwen2VisionConfig(
        depth=int(vision["depth"]),
        embed_dim=embed_dim,
        out_hidden_size=int(vision["hidden_size"]),
        hidden_act=str(vision["hidden_act"]),
        mlp_hidden_dim=int(embed_dim * vision["mlp_ratio"]),
        num_heads=num_heads,
        in_channels=int(vision["in_channels"]),
        patch_size=int(vision["patch_size"]),
        spatial_merge_size=int(vision["spatial_merge_size"]),
        temporal_patch_size=int(vision["temporal_patch_size"]),
    )


def _parse_vision_25(vision: dict[str, Any], source: str) -> Qwen2VisionConfig:
    if vision["hidden_act"] != "silu":
        raise ModelFormatError(f"{source}: vision hidden_act {vision['hidden_act']!r} unsupported")
    embed_dim, num_heads = int(vision["hidden_size"]), int(vision["num_heads"])
    if embed_dim % num_heads or (embed_dim // num_heads) % 4:
        raise ModelFormatError(f"{source}: vision head_dim must be a multiple of 4")
    unit = int(vision["spatial_merge_size"]) * int(vision["patch_size"])
    if int(vision["window_size"]) % unit:
        raise ModelFormatError(f"{source}: window_size must be a multiple of {unit}")
    return Qwen2VisionConfig(
        depth=int(vision["depth"]),
        embed_dim=embed_dim,
        out_hidden_size=int(vision["out_hidden_size"]),
        hidden_act="silu",
        mlp_hidden_dim=int(vision["intermediate_size"]),
        num_heads=num_heads,
        in_channels=int(vision.get("in_channels", vision.get("in_chans", 3))),
        patch_size=int(vision["patch_size"]),
        spatial_merge_size=int(vision["spatial_merge_size"]),
        temporal_patch_size=int(vision["temporal_patch_size"]),
        windowed=True,
        window_size=int(vision["window_size"]),
        fullatt_blocks=tuple(int(i) for i in vision["fullatt_block_indexes"]),
    )
