"""How large an image may become in tokens: the checkpoint's processor bounds, lowered by a
deployment.

Dynamic-resolution towers (Qwen2-VL and its successors) resize an image to at most the
processor's ``max_pixels`` (released Qwen2-VL / Qwen2.5-VL: 12.8 MP, 16,384 tokens). The
engine sizes its image cache and KV pages so that one such image always fits, and a
deployment may lower ``max_pixels`` (``--processor-max-pixels``, as vLLM's
``mm_processor_kwargs``) so that large photos are resized further rather than refused. Every
place that turns an image size into tokens (processor, token rule, M-RoPE) reads the bound
from here, so they agree.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from epd_engine.model.gemma3_config import Gemma3ModelConfig
from epd_engine.model.model_config import LlavaModelConfig, read_json
from epd_engine.model.qwen2_vl_config import Qwen2VLModelConfig
from epd_engine.model.qwen3_vl_config import Qwen3VLModelConfig

AnyModelConfig = LlavaModelConfig | Qwen2VLModelConfig | Qwen3VLModelConfig | Gemma3ModelConfig
DEFAULT_MIN_PIXELS = 56 * 56  # transformers' Qwen2VLImageProcessor defaults
DEFAULT_MAX_PIXELS = 28 * 28 * 1280


@dataclass(frozen=True)
class PixelBounds:
    """The resize rule's inputs: pixel range and the side multiple (patch x merge)."""

    min_pixels: int
    max_pixels: int
    patch: int
    merge: int

    @property
    def factor(self) -> int:
        return self.patch * self.merge

    @property
    def largest_image_tokens(self) -> int:
        # smart_resize keeps h x w <= max_pixels in multiples of factor; a token is factor^2
        return max(1, self.max_pixels // (self.factor * self.factor))


def checkpoint_pixel_bounds(model_dir: Path, patch: int, merge: int) -> PixelBounds:
    """The bounds in the checkpoint's ``preprocessor_config.json`` (``max_pixels`` or
    ``size.longest_edge``), transformers' defaults where it says nothing."""
    path = Path(model_dir) / "preprocessor_config.json"
    pre = read_json(path) if path.is_file() else {}
    size = pre.get("size") or {}
    return PixelBounds(
        min_pixels=int(pre.get("min_pixels") or size.get("shortest_edge") or DEFAULT_MIN_PIXELS),
        max_pixels=int(pre.get("max_pixels") or size.get("longest_edge") or DEFAULT_MAX_PIXELS),
        patch=int(pre.get("patch_size") or patch),
        merge=int(pre.get("merge_size") or merge),
    )


def pixel_bounds(model_dir: Path, config: Qwen2VLModelConfig | Qwen3VLModelConfig) -> PixelBounds:
    """The checkpoint's bounds with the deployment's ``max_pixels`` (if any) applied."""
    bounds = checkpoint_pixel_bounds(
        model_dir, config.vision.patch_size, config.vision.spatial_merge_size
    )
    if config.processor_max_pixels is None:
        return bounds
    return replace(bounds, max_pixels=config.processor_max_pixels)


def with_max_pixels(model_dir: Path, config: AnyModelConfig, max_pixels: int | None) -> Any:
    """``config`` carrying a deployment's ``max_pixels``; refused where it cannot apply."""
    if max_pixels is None:
        return config
    if not isinstance(config, Qwen2VLModelConfig | Qwen3VLModelConfig):
        raise ValueError(
            "--processor-max-pixels applies to dynamic-resolution models (Qwen2-VL, "
            f"Qwen2.5-VL, Qwen3-VL); {type(config).__name__} resizes every image to one size"
        )
    bounds = checkpoint_pixel_bounds(
        model_dir, config.vision.patch_size, config.vision.spatial_merge_size
    )
    if not bounds.min_pixels <= max_pixels <= bounds.max_pixels:
        raise ValueError(
            f"--processor-max-pixels {max_pixels} must be within the checkpoint's processor "
            f"bounds [{bounds.min_pixels}, {bounds.max_pixels}] (it may only lower max_pixels)"
        )
    return replace(config, processor_max_pixels=max_pixels)


def largest_image_tokens(model_dir: Path, config: AnyModelConfig) -> int:
    """LLM tokens of the largest image this model takes (after its resize)."""
    if isinstance(config, Qwen2VLModelConfig | Qwen3VLModelConfig):
        return pixel_bounds(model_dir, config).largest_image_tokens
    return config.num_image_tokens  # LLaVA, Gemma 3: every image is resized to one size


def lower_processor_max_pixels(processor: Any, max_pixels: int) -> None:
    """Make a loaded transformers image processor resize to at most ``max_pixels``
    (``Qwen2VLImageProcessor.preprocess`` reads ``max_pixels`` and ``size``)."""
    image_processor = processor.image_processor
    image_processor.max_pixels = max_pixels
    image_processor.size = {**image_processor.size, "longest_edge": max_pixels}
