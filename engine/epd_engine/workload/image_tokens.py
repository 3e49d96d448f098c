"""Visual tokens per image for the model families the papers serve (no processor needed).

A trace stores tokens per image so the simulator can cost encode and prefill without the model.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from epd_engine.contracts.image_grid import smart_resize

ImageTokenizer = Callable[[int, int], int]  # (width, height) -> visual tokens


def llava_1_5(width: int, height: int) -> int:
    """LLaVA-1.5: every image resized to 336×336 → 24×24 patches = 576 tokens (HydraInfer)."""
    return 576


def llava_next(width: int, height: int) -> int:
    """LLaVA-NeXT "anyres": a 336 base view plus up to 4 336-px tiles of the best-fit grid.

    Approximation of the processor (which also unpads): 576 × (1 + tiles), tiles <= 4, so
    2,880 tokens at most, the documented maximum.
    """
    tiles = min(4, math.ceil(width / 336) * math.ceil(height / 336))
    return 576 * (1 + tiles)


def qwen2_vl(width: int, height: int) -> int:
    """Qwen2-VL / Qwen2.5-VL: 14-px patches merged 2×2 → one token per 28×28 pixels, by the
    processor's own ``smart_resize`` with ``Qwen2-VL-7B-Instruct``'s bounds (min_pixels
    3,136, max_pixels 12,845,056), as the engine counts them.

    Matches EPD-Serve's transfer table: 280×280 → 100, 560×560 → 400, 720×1280 → 1196,
    1080×1920 → 2691 tokens.
    """
    h, w = smart_resize(height, width, 28, 56 * 56, 12_845_056)
    return (h // 28) * (w // 28)


def qwen3_vl(width: int, height: int) -> int:
    """Qwen3-VL: 16-px patches merged 2×2 → a token per 32×32 px, by the processor's
    ``smart_resize`` with ``Qwen3-VL-8B-Instruct``'s bounds (size.shortest_edge 65,536,
    longest_edge 16,777,216), as the engine counts them (640×640 → 400, vLLM post)."""
    h, w = smart_resize(height, width, 32, 65_536, 16_777_216)
    return (h // 32) * (w // 32)


def gemma3(width: int, height: int) -> int:
    """Gemma 3: every image resized to 896x896, its 64x64 SigLIP patches pooled to 16x16 =
    256 tokens (``mm_tokens_per_image``; pan-and-scan crops, which add images, unsupported)."""
    return 256


IMAGE_TOKENIZERS: dict[str, ImageTokenizer] = {
    "llava-1.5": llava_1_5,
    "llava-next": llava_next,
    "qwen2-vl": qwen2_vl,
    "qwen3-vl": qwen3_vl,
    "gemma3": gemma3,
}


def get_image_tokenizer(name: str) -> ImageTokenizer:
    try:
        return IMAGE_TOKENIZERS[name]
    except KeyError:
        known = ", ".join(sorted(IMAGE_TOKENIZERS))
        raise ValueError(f"unknown model family {name!r}; known: {known}") from None
