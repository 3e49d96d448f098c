"""Real request payloads from trace records: prompt text of the right length and real images.

Images are drawn (not noise) so they compress like photos-of-things, sized from the trace's
width/height and seeded by the image hash: a repeated hash gives byte-identical pictures, so
the server's encoder-output cache sees the reuse the trace describes.
"""

from __future__ import annotations

import base64
import hashlib
import io
import random
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from epd_engine.contracts.trace import ImageRef, TraceRecord

if TYPE_CHECKING:
    from epd_engine.bench.token_prompts import TokenExactPrompts

# Short common words: about one token each (with their leading space) in BPE tokenizers, so
# N words ≈ N text tokens. The server's usage.prompt_tokens reports the exact count.
_WORD_TEXT = (
    "the of and to in is was for on are with as his they at be this from have or one had by "
    "word but not what all were we when your can said there use an each which she do how their "
    "if will up other about out many then them these so some her would make like him into time "
    "has look two more write go see number no way could people my than first water been call "
    "who oil its now find long down day did get come made may part over new sound take only "
    "little work know place year live me back give most very after thing our just name good "
    "man think say great where help through much before line right too mean old any same tell "
    "boy follow came want show also around form three small set put end does another well large"
)
_WORDS = tuple(_WORD_TEXT.split())


def prompt_text(num_tokens: int, seed: str) -> str:
    """About ``num_tokens`` tokens of text; distinct per seed so no two prompts share a prefix."""
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, num_tokens)))


def _seed_of(image_hash: str) -> int:
    return int.from_bytes(hashlib.sha256(image_hash.encode()).digest()[:8], "big")


@lru_cache(maxsize=512)
def image_bytes(image_hash: str, width: int, height: int, fmt: str = "jpeg") -> bytes:
    """A deterministic picture: background plus coloured shapes, chosen by ``image_hash``."""
    from PIL import Image, ImageDraw  # engine extra; only the driver needs it

    rng = random.Random(_seed_of(image_hash))

    def colour() -> tuple[int, int, int]:
        return (rng.randrange(256), rng.randrange(256), rng.randrange(256))

    image = Image.new("RGB", (width, height), colour())
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x0, y0 = rng.randrange(width), rng.randrange(height)
        x1, y1 = x0 + rng.randrange(1, width // 2 + 2), y0 + rng.randrange(1, height // 2 + 2)
        shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
        shape((x0, y0, x1, y1), fill=colour())
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG" if fmt == "jpeg" else "PNG", quality=90)
    return buffer.getvalue()


def image_data_url(image: ImageRef, fmt: str = "jpeg") -> str:
    data = base64.b64encode(image_bytes(image.hash, image.width, image.height, fmt)).decode()
    return f"data:image/{fmt};base64,{data}"


@dataclass(frozen=True)
class Payload:
    """One request's chat messages and the ``usage.prompt_tokens`` the server should report
    (None when no tokenizer was given: lengths are then approximate, in words)."""

    messages: list[dict[str, Any]]
    expected_prompt_tokens: int | None = None


def chat_payload(
    record: TraceRecord,
    index: int,
    fmt: str = "jpeg",
    prompts: TokenExactPrompts | None = None,
    block_tokens: int = 512,
) -> Payload:
    """OpenAI chat messages for one record: text-only as a plain string (widest compatibility).

    With ``prompts`` the text has exactly the record's token count (see ``token_prompts``);
    the expected usage then adds the record's image tokens.
    """
    seed = record.request_id or str(index)
    expected = None
    if prompts is None:
        text = prompt_text(record.prompt_tokens, seed)
    else:
        blocks = record.hash_ids or ()
        block = record.hash_block_tokens or block_tokens  # a live trace says its own
        text = prompts.text(record.prompt_tokens, seed, record.num_images, blocks, block)
        # template mode: the trace's count is the intent; content mode: text + template
        exact = prompts.mode == "template"
        text_tokens = (
            record.prompt_tokens if exact else prompts.server_count(text, record.num_images)
        )
        expected = text_tokens + record.image_tokens
    if record.text_only:
        return Payload([{"role": "user", "content": text}], expected)
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": image_data_url(image, fmt)}}
        for image in record.images
    ]
    parts.append({"type": "text", "text": text})
    return Payload([{"role": "user", "content": parts}], expected)


def chat_messages(record: TraceRecord, index: int, fmt: str = "jpeg") -> list[dict[str, Any]]:
    """Chat messages of ``chat_payload`` without a tokenizer (approximate lengths)."""
    return chat_payload(record, index, fmt).messages
