"""The image-size rule of dynamic-resolution vision towers (Qwen2-VL and its successors): the
engine sizes images with it and the workload generators count their tokens with it, so both
live on one definition (no torch)."""

from __future__ import annotations

import math


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """transformers' ``qwen2_vl.image_processing_qwen2_vl.smart_resize``: the size an image
    is resized to (multiples of ``factor``, pixel count within bounds, aspect kept)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio must be below 200, got {width}x{height}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar
