"""Parse a Hugging Face Qwen3-VL ``config.json`` into the numbers our model needs.

The hub's ``Qwen/Qwen3-VL-8B-Instruct`` nests the text fields under ``text_config`` and the
ViT's under ``vision_config``. Missing fields take the defaults of transformers'
``Qwen3VLTextConfig`` / ``Qwen3VLVisionConfig``.

What differs from Qwen2-VL for serving: the decoder normalises q and k per head (Qwen3),
M-RoPE is *interleaved* (rotary pair ``j`` reads t, h, w in turn), and the ViT hands the LM
``1 + len(deepstack_visual_indexes)`` features per image token: the merger's, added to the
embeddings, and one per DeepStack level, added to the hidden states after LM layer ``i``.
An image-cache row holds them all side by side (``image_row_size``), so whatever moves
image pages moves every level.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epd_engine.model.model_config import ModelFormatError, read_hf_config

IMAGE_PAGE_TOKENS = 64  # as Qwen2-VL: a 512x512 image (256 tokens) takes 4 pages
_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 128000,
    "rms_norm_eps": 1e-6,
    "rope_theta": 5000000.0,
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
_VISION_DEFAULTS: dict[str, Any] = {
    "depth": 27,
    "hidden_size": 1152,
    "hidden_act": "gelu_pytorch_tanh",
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 3584,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [8, 16, 24],
}


@dataclass(frozen=True)
class Qwen3VisionConfig:
    """The ViT: patch embed (with bias) + learned position embeddings on a square grid
    (bilinearly interpolated to each image's patch grid), ``depth`` blocks with 2-D rotary,
    a merger, and one more merger per DeepStack level (read after those blocks)."""

    depth: int
    embed_dim: int
    out_hidden_size: int  # the mergers' output width: the text hidden size
    hidden_act: str
    mlp_hidden_dim: int
    num_heads: int
    in_channels: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    num_position_embeddings: int  # a (side x side) grid
    deepstack_indexes: tuple[int, ...]  # blocks whose output feeds a DeepStack level

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch as the image processor emits them."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def position_grid_side(self) -> int:
        return int(self.num_position_embeddings**0.5)


@dataclass(frozen=True)
class Qwen3VLModelConfig:
    """Qwen3-VL (dense): the ViT above + a Qwen3 decoder (q/k norm) with interleaved M-RoPE."""

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
    vision: Qwen3VisionConfig
    torch_dtype: str | None
    # a deployment's lower bound on resized images (``--processor-max-pixels``); None: the
    # checkpoint's preprocessor_config.json (model/image_bounds.py)
    processor_max_pixels: int | None = None

    uses_mrope = True
    mrope_interleaved = True  # pair j reads stream (t, h, w)[j % 3] within the sections
    fixed_image_tokens = None  # by resolution: the cost model reads each image's from the trace

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.eos_token_id
        return list(eos) if isinstance(eos, list) else [eos]

    @property
    def image_page_tokens(self) -> int:
        return IMAGE_PAGE_TOKENS

    @property
    def merge_unit(self) -> int:
        """Patches merged into one LLM token (``spatial_merge_size ** 2``)."""
        return self.vision.spatial_merge_size**2

    @property
    def num_deepstack_levels(self) -> int:
        return len(self.vision.deepstack_indexes)

    @property
    def image_row_size(self) -> int:
        """Values per image token in the image cache: the embedding, then each DeepStack
        level's feature (``[(1 + levels) * H]``)."""
        return (1 + self.num_deepstack_levels) * self.hidden_size

    @classmethod
    def from_dir(cls, model_dir: Path) -> Qwen3VLModelConfig:
        return cls.from_dict(*read_hf_config(model_dir))

    @classmethod
    def from_dict(
        cls,
        raw: dict[str, Any],
        generation: dict[str, Any] | None = None,
        source: str = "config.json",
    ) -> Qwen3VLModelConfig:
        if raw.get("model_type") != "qwen3_vl":
            raise ModelFormatError(
                f"{source}: model_type is {raw.get('model_type')!r}, expected 'qwen3_vl'"
            )
        text = {**_TEXT_DEFAULTS, **(raw.get("text_config") or {})}
        if text["hidden_act"] != "silu":
            raise ModelFormatError(f"{source}: text_config.hidden_act must be 'silu'")
        if text.get("attention_bias"):
            raise ModelFormatError(f"{source}: text_config.attention_bias is not supported")
        rope = text.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", "mrope"):
            raise ModelFormatError(f"{source}: rope_scaling type {rope!r} is not supported")
        if not rope.get("mrope_interleaved", True):
            raise ModelFormatError(f"{source}: only interleaved M-RoPE is supported")
        head_dim = int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])
        section = rope.get("mrope_section", [24, 20, 20])
        if not (isinstance(section, list) and len(section) == 3 and sum(section) == head_dim // 2):
            raise ModelFormatError(
                f"{source}: rope_scaling.mrope_section must be three ints summing to "
                f"head_dim / 2 = {head_dim // 2}, got {section!r}"
            )
        hidden = int(text["hidden_size"])
        vision = _parse_vision({**_VISION_DEFAULTS, **(raw.get("vision_config") or {})}, source)
        if vision.out_hidden_size != hidden:
            raise ModelFormatError(
                f"{source}: vision_config.out_hidden_size {vision.out_hidden_size} "
                f"!= text hidden_size {hidden}"
            )
        eos = (generation or {}).get("eos_token_id", text["eos_token_id"])
        bos = text.get("bos_token_id")
        num_heads = int(text["num_attention_heads"])
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
            tie_word_embeddings=bool(
                raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
            ),
            vision=vision,
            torch_dtype=raw.get("torch_dtype", raw.get("dtype", text.get("dtype"))),
        )


def _parse_vision(vision: dict[str, Any], source: str) -> Qwen3VisionConfig:
    if vision["hidden_act"] not in ("gelu_pytorch_tanh", "gelu"):
        raise ModelFormatError(f"{source}: vision hidden_act {vision['hidden_act']!r} unsupported")
    embed_dim, num_heads = int(vision["hidden_size"]), int(vision["num_heads"])
    if embed_dim % num_heads or (embed_dim // num_heads) % 4:
        raise ModelFormatError(f"{source}: vision head_dim must be a multiple of 4")
    depth = int(vision["depth"])
    indexes = tuple(int(i) for i in vision["deepstack_visual_indexes"])
    if any(not 0 <= i < depth for i in indexes):
        raise ModelFormatError(
            f"{source}: deepstack_visual_indexes {list(indexes)} must be blocks 0..{depth - 1}"
        )
    side = int(int(vision["num_position_embeddings"]) ** 0.5)
    if side * side != int(vision["num_position_embeddings"]):
        raise ModelFormatError(f"{source}: num_position_embeddings must be a square")
    return Qwen3VisionConfig(
        depth=depth,
        embed_dim=embed_dim,
        out_hidden_size=int(vision["out_hidden_size"]),
        hidden_act=str(vision["hidden_act"]),
        mlp_hidden_dim=int(vision["intermediate_size"]),
        num_heads=num_heads,
        in_channels=int(vision["in_channels"]),
        patch_size=int(vision["patch_size"]),
        spatial_merge_size=int(vision["spatial_merge_size"]),
        temporal_patch_size=int(vision["temporal_patch_size"]),
        num_position_embeddings=int(vision["num_position_embeddings"]),
        deepstack_indexes=indexes,
    )
