"""Turn an OpenAI chat request into an engine request: images, prompt, sampling parameters."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from epd_engine.api.completions import CompletionRequest
from epd_engine.api.protocol import ChatCompletionRequest, ImagePart
from epd_engine.api.validation import (
    check_chat_request,
    check_completion_request,
    check_prompt_chars,
    check_prompt_tokens,
    prompt_token_limit,
)
from epd_engine.config import EngineConfig
from epd_engine.contracts.errors import ClientError
from epd_engine.inputs.images import ImageLimits, decode_data_url, probe
from epd_engine.inputs.preprocess_pool import PreprocessPool, decode_and_prepare
from epd_engine.inputs.processor import InputProcessor, PreparedPrompt
from epd_engine.inputs.remote_images import RemoteImagePolicy, fetch_image
from epd_engine.sampling import SamplingParams


async def fetch_image_bytes(url: str, http: httpx.AsyncClient, config: EngineConfig) -> bytes:
    if url.startswith("data:"):
        return decode_data_url(url, config.max_image_bytes)
    policy = RemoteImagePolicy(config.remote_image_hosts, config.max_image_bytes)
    return await fetch_image(url, policy, http)


async def fetch_images(
    request: ChatCompletionRequest, http: httpx.AsyncClient, config: EngineConfig
) -> tuple[list[bytes], ImageLimits]:
    """The request's image bytes, fetched and checked against the limits from their headers
    (nothing decoded yet), and the limits their decoding must keep to."""
    num_images = request.num_images()
    if num_images > config.max_images_per_request:
        raise ClientError(
            f"{num_images} images in the request; at most {config.max_images_per_request}",
            param="messages",
        )
    urls = [
        p.image_url.url for m in request.messages for p in m.parts() if isinstance(p, ImagePart)
    ]
    limits = ImageLimits(config.max_image_bytes, config.max_image_pixels, config.max_request_pixels)
    blobs = [await fetch_image_bytes(u, http, config) for u in urls]
    # headers first: the request's total is refused before any image is decoded
    sizes = [probe(b, limits) for b in blobs]
    total = sum(w * h for w, h in sizes)
    if total > limits.max_request_pixels:
        raise ClientError(
            f"the request's images have {total} pixels; at most {limits.max_request_pixels}",
            param="messages",
        )
    return blobs, limits


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
    request: ChatCompletionRequest | CompletionRequest, num_prompt_tokens: int, max_model_len: int
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
    if isinstance(request, ChatCompletionRequest):
        logprobs, top_logprobs = request.logprobs, request.top_logprobs or 0
    else:  # completions: ``logprobs`` is the number of alternatives
        logprobs, top_logprobs = request.logprobs is not None, request.logprobs or 0
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            stop=request.stop_list,
            ignore_eos=request.ignore_eos,
            min_tokens=request.min_tokens,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
        )
    except ValueError as exc:
        raise ClientError(str(exc)) from exc


async def prepare(
    request: ChatCompletionRequest | CompletionRequest,
    processor: InputProcessor,
    http: httpx.AsyncClient,
    config: EngineConfig,
    max_model_len: int,
    pool: PreprocessPool | None = None,
) -> tuple[PreparedPrompt, SamplingParams]:
    """``pool``: decode images and run the processor in its worker processes (else in a
    thread of this one)."""
    max_prompt_tokens = prompt_token_limit(config.max_prompt_tokens, max_model_len)
    if isinstance(request, CompletionRequest):
        check_completion_request(request, max_prompt_tokens)
        prompt = await asyncio.to_thread(prepare_completion, request, processor)
        check_prompt_tokens(len(prompt.token_ids), max_prompt_tokens)
        return prompt, sampling_params(request, len(prompt.token_ids), max_model_len)
    check_chat_request(request)
    check_prompt_chars(request, max_prompt_tokens)
    blobs, limits = await fetch_images(request, http, config)
    messages = hf_messages(request)
    if pool is None:
        prompt = await asyncio.to_thread(decode_and_prepare, processor, messages, blobs, limits)
    else:
        prompt = await pool.prepare(messages, blobs, limits)
    if config.max_prompt_tokens is not None:  # else the context window check below says it
        check_prompt_tokens(len(prompt.token_ids), max_prompt_tokens)
    params = sampling_params(request, len(prompt.token_ids), max_model_len)
    return prompt, params


def prepare_completion(request: CompletionRequest, processor: InputProcessor) -> PreparedPrompt:
    """Prompt token ids (tokenized, or checked against the vocabulary); no images."""
    if request.echo:
        raise ClientError("echo is not supported", param="echo")
    prompt = request.single_prompt()
    if isinstance(prompt, str):
        token_ids: list[int] = processor.tokenizer.encode(prompt)
    else:
        vocab_size = len(processor.tokenizer)
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ClientError(
                f"prompt token ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})",
                param="prompt",
            )
        token_ids = list(prompt)
    image_token = processor.model_config.image_token_index
    if image_token in token_ids:
        raise ClientError("completions are text only: the image token is not allowed",
                          param="prompt")  # fmt: skip
    return PreparedPrompt(token_ids, [], [])
