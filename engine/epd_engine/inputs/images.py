"""Image inputs: decode ``data:`` URLs into PIL images with a content hash, within limits.

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

from epd_engine.contracts.errors import ClientError


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


# Formats a client may send: each decoder is attack surface, and these cover real uploads.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# Degenerate shapes: a side of 1 or 3 pixels reads as a channel axis to the image processor
# (which raised, a 500), and a long thin strip is upscaled to a huge one on resize.
MIN_SIDE = 8
MAX_ASPECT_RATIO = 20


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 4096 * 4096  # per image
    max_request_pixels: int = 2 * 4096 * 4096  # all images of one request


def probe(data: bytes, limits: ImageLimits) -> tuple[int, int]:
    """Width and height from the header alone (nothing decoded); a 400 for what we refuse."""
    if len(data) > limits.max_bytes:
        raise ClientError(f"image is larger than {limits.max_bytes} bytes", param="image_url")
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as opened:
            width, height = opened.size
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ClientError(f"cannot decode image: {exc}", param="image_url") from exc
    if width * height > limits.max_pixels:
        raise ClientError(
            f"image is {width}x{height}; at most {limits.max_pixels} pixels", param="image_url"
        )
    if min(width, height) < MIN_SIDE:
        raise ClientError(
            f"image is {width}x{height}; each side must be at least {MIN_SIDE} pixels",
            param="image_url",
        )
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise ClientError(
            f"image is {width}x{height}; the aspect ratio must be at most {MAX_ASPECT_RATIO}:1",
            param="image_url",
        )
    return width, height


def load_image(data: bytes, limits: ImageLimits) -> LoadedImage:
    """Decode one image ``probe`` accepted (CPU work: run it off the event loop)."""
    probe(data, limits)
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as opened:
            image = opened.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ClientError(f"cannot decode image: {exc}", param="image_url") from exc
    digest = hashlib.sha256(data).hexdigest()
    return LoadedImage(image, digest, image.width, image.height)
