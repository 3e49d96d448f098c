"""Real PNG images as base64 data URLs, distinct by seed."""

from __future__ import annotations

import base64
import io
import struct
import zlib

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


def solid_png(size: tuple[int, int]) -> bytes:
    """A one-colour PNG: any size in a few hundred bytes."""
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def png_claiming_size(size: tuple[int, int]) -> bytes:
    """A decompression bomb's shape: a small real PNG whose header declares ``size`` (the
    IHDR chunk rewritten, its CRC fixed), so a decoder would allocate for all of it."""
    data = bytearray(solid_png((8, 8)))
    ihdr = data.index(b"IHDR")
    data[ihdr + 4 : ihdr + 12] = struct.pack(">II", *size)
    crc = zlib.crc32(bytes(data[ihdr : ihdr + 17]))
    data[ihdr + 17 : ihdr + 21] = struct.pack(">I", crc)
    return bytes(data)


def as_data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()
