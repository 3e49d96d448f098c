"""Checks on a chat request beyond its schema, made at the edge (router and instance) before
any work: ranges the engine step would otherwise trip over, text that cannot be encoded,
parameters we do not implement, and roles that cannot serve a request alone.

A value the engine cannot take must be a 400 here: one request's bad seed once crashed the
engine step and failed every request in its batch.
"""

from __future__ import annotations

from typing import Any

from epd_engine.api.completions import CompletionRequest
from epd_engine.api.protocol import ChatCompletionRequest, TextPart
from epd_engine.config import STAGE_ORDER, Role, Stage
from epd_engine.contracts.errors import ClientError

# what torch.Generator.manual_seed takes: a signed or unsigned 64-bit integer
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1
PENALTY_RANGES = {
    "frequency_penalty": (-2.0, 2.0),
    "presence_penalty": (-2.0, 2.0),
}
LOGIT_BIAS_RANGE = (-100.0, 100.0)


def _param(body: ChatCompletionRequest | CompletionRequest, name: str) -> Any:
    """A field whether the schema declares it or keeps it as an extra."""
    if name in type(body).model_fields:
        return getattr(body, name)
    return (body.model_extra or {}).get(name)


def check_chat_request(body: ChatCompletionRequest) -> None:
    check_unsupported(body)
    check_ranges(body)
    check_text(body)


def check_unsupported(body: ChatCompletionRequest) -> None:
    """Parameters that would change the answer and that we do not implement: a 400 naming
    them, never silence."""
    if _param(body, "tools"):
        raise ClientError("tools (function calling) are not supported", param="tools")
    if _param(body, "tool_choice") not in (None, "none"):
        raise ClientError("tool_choice is not supported (no tools)", param="tool_choice")
    if _param(body, "functions") or _param(body, "function_call") not in (None, "none"):
        raise ClientError("functions are not supported", param="functions")
    response_format = _param(body, "response_format")
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind != "text":
            raise ClientError(
                f"response_format {kind!r} is not supported; only plain text",
                param="response_format",
            )


def check_ranges(body: ChatCompletionRequest | CompletionRequest) -> None:
    seed = body.seed
    if seed is not None and not MIN_SEED <= seed <= MAX_SEED:
        raise ClientError(
            f"seed must be a 64-bit integer ({MIN_SEED} to {MAX_SEED}), got {seed}", param="seed"
        )
    for name, (low, high) in PENALTY_RANGES.items():
        value = _param(body, name)
        if value is not None and not (_is_number(value) and low <= value <= high):
            raise ClientError(f"{name} must be in [{low}, {high}], got {value!r}", param=name)
    bias = _param(body, "logit_bias")
    if bias:
        _check_logit_bias(bias)
    check_sampling_supported(body)


def check_sampling_supported(body: ChatCompletionRequest | CompletionRequest) -> None:
    """Penalties and logit biases in range but not implemented: a 400 naming them (they
    were accepted and silently ignored); their neutral values pass, as clients send them."""
    for name in PENALTY_RANGES:
        if _param(body, name):
            raise ClientError(
                f"{name} is not supported; only 0 (no penalty) is accepted", param=name
            )
    if _param(body, "logit_bias"):
        raise ClientError(
            "logit_bias is not supported; send an empty object or leave it out",
            param="logit_bias",
        )


def _check_logit_bias(bias: object) -> None:
    if not isinstance(bias, dict):
        raise ClientError("logit_bias must map token ids to numbers", param="logit_bias")
    low, high = LOGIT_BIAS_RANGE
    for key, value in bias.items():
        if not str(key).isdigit():
            raise ClientError(f"logit_bias key {key!r} is not a token id", param="logit_bias")
        if not (_is_number(value) and low <= value <= high):
            raise ClientError(
                f"logit_bias values must be in [{low}, {high}], got {value!r}", param="logit_bias"
            )


def check_completion_request(body: CompletionRequest, max_tokens: int | None) -> None:
    """``/v1/completions``: the chat checks that apply to a bare prompt (its length only
    where ``max_tokens`` is known)."""
    check_ranges(body)
    prompts = body.prompt if isinstance(body.prompt, list) else [body.prompt]
    texts = [p for p in prompts if isinstance(p, str)]
    for text in texts:
        _check_encodable(text, "prompt")
    for stop in body.stop_list:
        _check_encodable(stop, "stop")
    if max_tokens is not None and sum(len(t) for t in texts) > max_tokens * MAX_CHARS_PER_TOKEN:
        raise ClientError(
            f"prompt is longer than {max_tokens} tokens can be",
            param="prompt",
            code="context_length_exceeded",
        )


def check_text(body: ChatCompletionRequest) -> None:
    """Every string must be valid Unicode: JSON lets a lone surrogate (``"\\ud800"``) through,
    and the tokenizer then raised a 500."""
    for index, message in enumerate(body.messages):
        for part in message.parts():
            if isinstance(part, TextPart):
                _check_encodable(part.text, f"messages.{index}.content")
    for stop in body.stop_list:
        _check_encodable(stop, "stop")


def _check_encodable(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ClientError(
            f"{param} is not valid Unicode (a lone surrogate at character {exc.start})",
            param=param,
        ) from exc


MAX_CHARS_PER_TOKEN = 32  # no real token is longer: a cheap bound before tokenizing


def prompt_token_limit(max_prompt_tokens: int | None, max_model_len: int) -> int:
    return max_prompt_tokens or max_model_len - 1


def check_prompt_chars(body: ChatCompletionRequest, max_tokens: int) -> None:
    """Refuse a prompt that cannot fit before paying to tokenize it (a 60 MB text body)."""
    chars = sum(
        len(part.text) for m in body.messages for part in m.parts() if isinstance(part, TextPart)
    )
    if chars > max_tokens * MAX_CHARS_PER_TOKEN:
        raise ClientError(
            f"prompt has {chars} characters; at most {max_tokens} tokens are allowed",
            param="messages",
            code="context_length_exceeded",
        )


def check_prompt_tokens(num_tokens: int, max_tokens: int) -> None:
    if num_tokens > max_tokens:
        raise ClientError(
            f"prompt has {num_tokens} tokens; at most {max_tokens} are allowed",
            param="messages",
            code="context_length_exceeded",
        )


def check_role_serves(role: Role, has_images: bool) -> None:
    """An instance whose role lacks a stage the request needs cannot answer it alone (its
    own endpoint used to hang): say where to send it."""
    needed = {Stage.PREFILL, Stage.DECODE} | ({Stage.ENCODE} if has_images else set())
    missing = [stage.value for stage in STAGE_ORDER if stage in needed - role.stages]
    if missing:
        raise ClientError(
            f"this instance has role {role.value} and cannot run {', '.join(missing)} for "
            "this request; send requests to the router's /v1/chat/completions",
            code="wrong_endpoint",
        )


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
