"""Deterministic tokens for emulated instances: words in, word-shaped tokens out.

A prompt's ids are a hash of each word (so equal prompts share prefix-cache pages, as on a
real engine); an output token is a hash of the prompt and its position, so the same request
always gets the same text, whoever serves it.
"""

from __future__ import annotations

import hashlib
import zlib

VOCAB_SIZE = 32000


def prompt_token_ids(text: str) -> list[int]:
    """One id per whitespace-separated word (at least one token)."""
    words = text.split() or [""]
    return [zlib.crc32(word.encode()) % VOCAB_SIZE for word in words]


def output_token_id(prompt_ids: list[int], position: int) -> int:
    """The token at ``position`` of the output of a request with this prompt."""
    digest = hashlib.blake2b(f"{zlib.crc32(bytes(str(prompt_ids), 'ascii'))}:{position}".encode())
    return int.from_bytes(digest.digest()[:4], "little") % VOCAB_SIZE


def token_text(token_id: int) -> str:
    return f" t{token_id}"
