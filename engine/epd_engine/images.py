"""Image inputs: decode ``data:`` (and http) URLs into PIL images with a content hash.

The hash of the raw bytes keys the encoder-output cache, so the same picture sent twice
is encoded once.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from epd_engine.errors import ClientError


@dataclass(frozen=True)
class LoadedImage:
    image: Image.Image
    content_hash: str
    width: int
    height: int


def decode_data_url(url: str, max_bytes: int) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.startswith("data:") or ";base64" not in header:
        raise ClientError("image_url must be a base64 data: URL", param="image_url")
    if len(payload) * 3 // 4 > max_bytes:
        raise ClientError(f"image is larger than {max_bytes} bytes", param="image_url")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ClientError(f"image_url is not valid base64: {exc}", param="image_url") from exc


def load_image(data: bytes, max_bytes: int, max_pixels: int = 64_000_000) -> LoadedImage:
    if len(data) > max_bytes:
        raise ClientError(f"image is larger than {max_bytes} bytes", param="image_url")
    try:
        with Image.open(io.BytesIO(data)) as opened:
            if opened.width * opened.height > max_pixels:
                raise ClientError(
                    f"image is {opened.width}x{opened.height}; at most {max_pixels} pixels",
                    param="image_url",
                )
            image = opened.convert("RGB")
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise ClientError(f"cannot decode image: {exc}", param="image_url") from exc
    digest = hashlib.sha256(data).hexdigest()
    return LoadedImage(image, digest, image.width, image.height)
