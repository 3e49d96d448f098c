"""An OpenAI chat request -> the scheduler's ``Request``, without a tokenizer or images.

Images are never decoded: each counts the cost model's tokens per image and is keyed by a
hash of its URL (the same image, the same encoder-cache key). Image placeholder tokens come
first, then the words of the messages, as the simulator lays requests out.
"""

from __future__ import annotations

import hashlib

from epd_engine.api.protocol import ChatCompletionRequest, ImagePart, TextPart
from epd_engine.emulate.tokens import prompt_token_ids
from epd_engine.request import ImageRef, Request
from epd_engine.sampling import SamplingParams

DEFAULT_MAX_TOKENS = 16


def chat_request(request_id: str, body: ChatCompletionRequest, tokens_per_image: int) -> Request:
    texts: list[str] = []
    images: list[ImageRef] = []
    for message in body.messages:
        for part in message.parts():
            if isinstance(part, TextPart):
                texts.append(part.text)
            elif isinstance(part, ImagePart):
                content_hash = hashlib.sha256(part.image_url.url.encode()).hexdigest()
                offset = len(images) * tokens_per_image
                images.append(ImageRef(content_hash, offset, tokens_per_image))
    text_ids = prompt_token_ids(" ".join(texts))
    sampling = SamplingParams(
        max_tokens=body.max_completion_tokens or body.max_tokens or DEFAULT_MAX_TOKENS,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        ignore_eos=True,  # emulated tokens never end a request early: lengths are the asked
    )
    return Request(
        request_id=request_id,
        prompt_token_ids=[0] * (len(images) * tokens_per_image) + text_ids,
        sampling=sampling,
        images=images,
    )
