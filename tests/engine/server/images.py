"""Real PNG images as base64 data URLs, distinct by seed."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image


def png_bytes(seed: int, size: tuple[int, int] = (64, 48)) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def data_url(seed: int, size: tuple[int, int] = (64, 48)) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(seed, size)).decode()


def image_message(text: str, *seeds: int) -> dict[str, object]:
    parts: list[dict[str, object]] = [
        {"type": "image_url", "image_url": {"url": data_url(s)}} for s in seeds
    ]
    parts.append({"type": "text", "text": text})
    return {"role": "user", "content": parts}
