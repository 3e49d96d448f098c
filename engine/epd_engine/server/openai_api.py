"""Public OpenAI-compatible routes: ``/v1/chat/completions``, ``/v1/completions`` and
``/v1/models``."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from epd_engine.api.completions import (
    CompletionRequest,
    completion_response,
)
from epd_engine.api.logprobs import (
    choice_logprobs,
    completion_logprobs,
    logprob_content,
    token_text_of,
)
from epd_engine.api.protocol import (
    SSE_DONE,
    ChatCompletionRequest,
    TokenLogprob,
    Usage,
    chat_response,
    json_answer,
    sse_error,
    token_usage,
)
from epd_engine.api.streaming import ChunkWriter, Kind
from epd_engine.api.validation import check_role_serves
from epd_engine.contracts.errors import ClientError, ModelNotFound
from epd_engine.engine.async_engine import RequestOutput
from epd_engine.inputs.chat import prepare
from epd_engine.server.state import InstanceState

router = APIRouter()
Answer = Response  # json_answer's, or a StreamingResponse


def _state(request: Request) -> InstanceState:
    state: InstanceState = request.app.state.instance
    return state


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, object]:
    state = _state(request)
    return {
        "object": "list",
        "data": [
            {
                "id": state.config.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "epd",
                "max_model_len": state.engine.engine.max_model_len,
            }
        ],
    }


class _Timer:
    """Per-request latency bookkeeping for the TTFT/TPOT histograms and the SLO counter."""

    def __init__(self, state: InstanceState) -> None:
        self.state = state
        self.start_s = time.monotonic()
        self.token_times_s: list[float] = []

    def tokens(self, count: int, at_s: float) -> None:
        """``count`` tokens reached this server at ``at_s`` (monotonic)."""
        self.token_times_s.extend([at_s] * count)

    def finish(self, outcome: str) -> None:
        m = self.state.metrics
        labels = m.labels
        m.requests.labels(**labels, outcome=outcome).inc()
        m.e2e.labels(**labels).observe(time.monotonic() - self.start_s)
        if not self.token_times_s:
            return
        ttft_s = self.token_times_s[0] - self.start_s
        gaps = np.diff(self.token_times_s).tolist()
        m.observe_tokens(ttft_s, gaps, self.state.config.slo, success=outcome == "success")


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Answer:
    return await _serve("chat", body, request)


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Answer:
    return await _serve("completion", body, request)


async def _serve(
    kind: Kind, body: ChatCompletionRequest | CompletionRequest, request: Request
) -> Answer:
    state = _state(request)
    if body.model != state.config.model_name:
        raise ModelNotFound(
            f"model {body.model!r} does not exist; this server serves {state.config.model_name!r}",
            param="model",
            code="model_not_found",
        )
    if not state.ready:
        raise ClientError("server is starting", code="not_ready")
    check_role_serves(state.config.role, body.num_images() > 0)
    timer = _Timer(state)
    prompt, params = await prepare(
        body,
        state.processor,
        state.http,
        state.config,
        state.engine.engine.max_model_len,
        state.preprocess,
    )
    request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    outputs = state.engine.generate(
        request_id, prompt, params, state.processor.eos_token_ids, incremental=bool(body.stream)
    )
    first = await anext(outputs)  # surfaces admission errors as 4xx before streaming starts
    token_text = None  # set when the client asked for logprobs
    if params.logprobs:
        token_text = token_text_of(state.processor.tokenizer)
    if body.stream:
        writer = ChunkWriter(kind, request_id, body.model, body.stream_options)
        return StreamingResponse(
            _sse(first, outputs, writer, timer, token_text), media_type="text/event-stream"
        )
    text, final, content = await _collect(first, outputs, timer, token_text)
    usage = _usage(final)
    if kind == "chat":
        logprobs = choice_logprobs(content)
        return json_answer(
            chat_response(request_id, body.model, text, final.finish_reason, usage, logprobs)
        )
    entries = None if content is None else [entry.model_dump() for entry in content]
    shaped = None if entries is None else completion_logprobs(entries)
    return json_answer(
        completion_response(request_id, body.model, text, final.finish_reason, usage, shaped)
    )


async def _chain(
    first: RequestOutput, rest: AsyncIterator[RequestOutput], timer: _Timer
) -> AsyncIterator[RequestOutput]:
    """All outputs of one request, recording token times and the outcome on the way."""
    outcome = "aborted"  # unless it runs to its end: the client went away
    last_count = 0
    output = first
    try:
        while True:
            timer.tokens(output.num_output_tokens - last_count, output.published_s)
            last_count = output.num_output_tokens
            yield output
            if output.finish_reason is not None:
                outcome = "error" if output.error else "success"
                return
            output = await anext(rest)
    finally:
        timer.finish(outcome)


TokenText = Callable[[int], str]


async def _collect(
    first: RequestOutput,
    rest: AsyncIterator[RequestOutput],
    timer: _Timer,
    token_text: TokenText | None = None,
) -> tuple[str, RequestOutput, list[TokenLogprob] | None]:
    """The whole text, the last output and (with ``token_text``) every token's logprobs."""
    text: list[str] = []
    content: list[TokenLogprob] | None = [] if token_text else None
    final = first
    async for output in _chain(first, rest, timer):
        text.append(output.text_delta)
        if content is not None and token_text is not None:
            content += logprob_content(output.new_token_ids, output.logprobs, token_text)
        final = output
    if final.error:
        raise RuntimeError(final.error)
    return "".join(text), final, content


async def _sse(
    first: RequestOutput,
    rest: AsyncIterator[RequestOutput],
    writer: ChunkWriter,
    timer: _Timer,
    token_text: TokenText | None = None,
) -> AsyncIterator[str]:
    writer.num_cached_tokens = first.num_cached_tokens
    if opening := writer.start(first.num_prompt_tokens):
        yield opening
    final = first
    counted = 0  # output tokens already in a chunk
    async for output in _chain(first, rest, timer):
        final = output
        writer.num_cached_tokens = output.num_cached_tokens
        if output.error:
            yield sse_error(output.error)
            break
        logprobs = None
        if token_text is not None and output.logprobs:
            content = logprob_content(output.new_token_ids, output.logprobs, token_text)
            logprobs = [entry.model_dump() for entry in content]
        if output.text_delta or output.finish_reason or logprobs:
            new_tokens = output.num_output_tokens - counted
            counted = output.num_output_tokens
            yield writer.tokens(output.text_delta, new_tokens, output.finish_reason, logprobs)
    if totals := writer.usage(_usage(final)):
        yield totals
    yield SSE_DONE


def _usage(output: RequestOutput) -> Usage:
    return token_usage(output.num_prompt_tokens, output.num_output_tokens, output.num_cached_tokens)
