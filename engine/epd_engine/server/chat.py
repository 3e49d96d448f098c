"""Turn an OpenAI chat request into an engine request: images, prompt, sampling parameters."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from epd_engine.config import EngineConfig
from epd_engine.errors import ClientError
from epd_engine.images import LoadedImage, decode_data_url, load_image
from epd_engine.processor import InputProcessor, PreparedPrompt
from epd_engine.sampling import SamplingParams
from epd_engine.server.protocol import ChatCompletionRequest, ImagePart


async def fetch_image_bytes(url: str, http: httpx.AsyncClient, max_bytes: int) -> bytes:
    if url.startswith("data:"):
        return decode_data_url(url, max_bytes)
    if not url.startswith(("http://", "https://")):
        raise ClientError("image_url must be a data: or http(s) URL", param="image_url")
    try:
        response = await http.get(url, timeout=10.0)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        raise ClientError(f"cannot fetch image {url}: {exc}", param="image_url") from exc
    return response.content


async def load_images(
    request: ChatCompletionRequest, http: httpx.AsyncClient, config: EngineConfig
) -> list[LoadedImage]:
    num_images = request.num_images()
    if num_images > config.max_images_per_request:
        raise ClientError(
            f"{num_images} images in the request; at most {config.max_images_per_request}",
            param="messages",
        )
    urls = [
        p.image_url.url for m in request.messages for p in m.parts() if isinstance(p, ImagePart)
    ]
    blobs = [await fetch_image_bytes(u, http, config.max_image_bytes) for u in urls]
    return [load_image(b, config.max_image_bytes) for b in blobs]


def hf_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """OpenAI messages -> the Hugging Face chat-template form (``image`` parts, no URLs)."""
    messages = []
    for message in request.messages:
        content = [
            {"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": p.text}
            for p in message.parts()
        ]
        messages.append({"role": message.role, "content": content})
    return messages


def sampling_params(
    request: ChatCompletionRequest, num_prompt_tokens: int, max_model_len: int
) -> SamplingParams:
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise ClientError(
            f"prompt has {num_prompt_tokens} tokens; the context window is {max_model_len}",
            param="messages",
            code="context_length_exceeded",
        )
    max_tokens = request.max_completion_tokens or request.max_tokens or room
    if max_tokens > room:
        raise ClientError(
            f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds the "
            f"context window of {max_model_len}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            stop=request.stop_list,
            ignore_eos=request.ignore_eos,
            min_tokens=request.min_tokens,
            logprobs=request.logprobs,
            top_logprobs=request.top_logprobs or 0,
        )
    except ValueError as exc:
        raise ClientError(str(exc)) from exc


async def prepare(
    request: ChatCompletionRequest,
    processor: InputProcessor,
    http: httpx.AsyncClient,
    config: EngineConfig,
    max_model_len: int,
) -> tuple[PreparedPrompt, SamplingParams]:
    images = await load_images(request, http, config)
    prompt = await asyncio.to_thread(processor.prepare, hf_messages(request), images)
    params = sampling_params(request, len(prompt.token_ids), max_model_len)
    return prompt, params
