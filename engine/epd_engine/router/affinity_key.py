"""A request's affinity keys, read off its body (the router has no tokenizer).

- ``prefix_key``: what the prompt starts with -- a chat's messages up to and including its
  first user message (a conversation's later turns resend them; agents that share only a
  system prompt get different keys, and spread), or a completion prompt's first characters.
  Prefill and decode instances are chosen by it (``contracts/affinity.py``): the one that
  served the conversation's earlier turns holds their KV pages.
- ``image_key``: the request's first image (its URL; a data URL's digest): an encode-only
  entry instance is chosen by it, the one whose encoder cache holds that image.
"""

from __future__ import annotations

import hashlib

from epd_engine.api.completions import CompletionRequest
from epd_engine.api.protocol import ChatCompletionRequest, ImagePart, TextPart

PROMPT_CHARS = 1024  # a completion prompt's characters the key reads
PROMPT_IDS = 256  # a token-id prompt's ids the key reads


def _digest(*parts: str) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\x00")
    return digest.hexdigest()[:32]


def prefix_key(body: ChatCompletionRequest | CompletionRequest) -> str | None:
    if isinstance(body, CompletionRequest):
        prompt = body.prompt
        if isinstance(prompt, str):
            return _digest("prompt", prompt[:PROMPT_CHARS]) if prompt else None
        first = prompt[0] if prompt else None
        if isinstance(first, str):
            return _digest("prompt", first[:PROMPT_CHARS])
        if isinstance(first, int):
            return _digest("ids", repr(prompt[:PROMPT_IDS]))
        if isinstance(first, list):
            return _digest("ids", repr(first[:PROMPT_IDS]))
        return None
    parts: list[str] = []
    for message in body.messages:
        parts.append(message.role)
        for part in message.parts():
            if isinstance(part, TextPart):
                parts.append(part.text)
            elif isinstance(part, ImagePart):
                parts.append(_digest(part.image_url.url))
        if message.role == "user":
            break
    return _digest("chat", *parts)


def image_key(body: ChatCompletionRequest | CompletionRequest) -> str | None:
    if isinstance(body, CompletionRequest):
        return None
    for message in body.messages:
        for part in message.parts():
            if isinstance(part, ImagePart):
                return _digest("image", part.image_url.url)
    return None
