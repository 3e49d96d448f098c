"""The router's public OpenAI surface: same request/response shapes as an instance."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from epd_engine.api.auth import require_token
from epd_engine.api.completions import (
    CompletionRequest,
    completion_response,
)
from epd_engine.api.logprobs import completion_logprobs
from epd_engine.api.protocol import (
    SSE_DONE,
    ChatCompletionRequest,
    ChoiceLogprobs,
    Usage,
    chat_response,
    json_answer,
    sse_error,
    token_usage,
)
from epd_engine.api.streaming import ChunkWriter, Kind
from epd_engine.api.validation import check_chat_request, check_completion_request
from epd_engine.contracts.errors import ClientError, ModelNotFound, ServiceUnavailable
from epd_engine.router.dispatch import Dispatcher
from epd_engine.router.inflight import ClientChunk, InflightRequest

router = APIRouter()
Answer = Response  # json_answer's, or a StreamingResponse
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks its client is there


def _dispatcher(request: Request) -> Dispatcher:
    dispatcher: Dispatcher = request.app.state.dispatcher
    return dispatcher


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, object]:
    model = _dispatcher(request).settings.model
    return {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": 0, "owned_by": "epd"}],
    }


TRACE_CLOCK_HEADER = "X-EPD-Trace-Clock-S"


# The trace shows every request's shape and timing: internal (X-EPD-Token), though it is
# served on the public port, which clients and internal callers share.
@router.get("/v1/trace", dependencies=[Depends(require_token)])
async def trace(
    request: Request, since: float = 0.0, last: float | None = None, in_flight: bool = False
) -> StreamingResponse:
    """The live trace as JSONL: requests that arrived ``since`` seconds after router start, or
    (``last``) in the last that many seconds. Arrival times are seconds since router start;
    the ``X-EPD-Trace-Clock-S`` header is that clock now, so a caller knows the span covered.
    Finished requests only, unless ``in_flight``: then those not finished yet follow, marked
    (the planner's view of the offered rate)."""
    dispatcher = _dispatcher(request)
    clock_s = time.monotonic() - dispatcher.started_s
    if last is not None:
        since = max(since, clock_s - last)
    records = dispatcher.recorder.since(since)
    if in_flight:
        records += dispatcher.in_flight_records(since)
    lines = "".join(r.model_dump_json(exclude_none=True) + "\n" for r in records)
    return StreamingResponse(
        iter([lines]),
        media_type="application/x-ndjson",
        headers={TRACE_CLOCK_HEADER: f"{clock_s:.3f}"},
    )


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Answer:
    return await _serve("chat", body, request)


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Answer:
    body.single_prompt()  # a batch or an empty prompt is refused here, not on an instance
    return await _serve("completion", body, request)


async def _serve(
    kind: Kind, body: ChatCompletionRequest | CompletionRequest, request: Request
) -> Answer:
    dispatcher = _dispatcher(request)
    served = dispatcher.settings.model
    if body.model != served:
        raise ModelNotFound(
            f"model {body.model!r} does not exist; this router serves {served!r}",
            param="model",
            code="model_not_found",
        )
    if isinstance(body, ChatCompletionRequest):
        check_chat_request(body)
    else:  # the prompt's length is checked where it is tokenized (on the instance)
        check_completion_request(body, max_tokens=None)
    inflight = await dispatcher.start(body)
    chunks = _chunks(dispatcher, inflight)
    if body.stream:
        writer = ChunkWriter(kind, inflight.router_request_id, body.model, body.stream_options)
        return StreamingResponse(_sse(chunks, inflight, writer), media_type="text/event-stream")
    collecting = asyncio.ensure_future(_collect(chunks))
    try:  # a non-streaming client that leaves is noticed too, and its request aborted
        text, finish = await _unless_disconnected(collecting, request)
    finally:
        await chunks.aclose()
    if finish is None or finish.error:
        # placed but failed (its instances died, no progress): a clean 503, not a 500
        raise ServiceUnavailable((finish and finish.error) or "request ended without output")
    usage = _usage(inflight)
    if kind == "chat":
        logprobs = None
        if isinstance(body, ChatCompletionRequest) and body.logprobs:
            logprobs = ChoiceLogprobs.model_validate({"content": inflight.logprobs})
        chat = chat_response(
            inflight.router_request_id, body.model, text, finish.finish_reason, usage, logprobs
        )
        return json_answer(chat)
    asked = isinstance(body, CompletionRequest) and body.logprobs is not None
    logprobs_shaped = completion_logprobs(inflight.logprobs) if asked else None
    completion = completion_response(
        inflight.router_request_id, body.model, text, finish.finish_reason, usage, logprobs_shaped
    )
    return json_answer(completion)


async def _collect(chunks: AsyncIterator[ClientChunk]) -> tuple[str, ClientChunk | None]:
    text = []
    finish: ClientChunk | None = None
    async for chunk in chunks:
        text.append(chunk.text)
        finish = chunk
    return "".join(text), finish


async def _unless_disconnected(
    work: asyncio.Future[tuple[str, ClientChunk | None]], request: Request
) -> tuple[str, ClientChunk | None]:
    while True:
        done, _ = await asyncio.wait({work}, timeout=DISCONNECT_POLL_S)
        if done:
            return work.result()
        if await request.is_disconnected():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            raise ClientError("client disconnected", code="client_disconnected")


async def _chunks(
    dispatcher: Dispatcher, inflight: InflightRequest
) -> AsyncGenerator[ClientChunk, None]:
    """Chunks until the request finishes; a client that leaves counts as aborted. A request
    makes progress or ends: no event for ``progress_timeout_s`` (or the whole request past
    ``request_timeout_s``) fails it."""
    outcome = "aborted"
    settings = dispatcher.settings
    deadline_s = inflight.arrival_s + settings.request_timeout_s
    try:
        while True:
            wait_s = min(settings.progress_timeout_s, deadline_s - time.monotonic())
            try:  # asyncio.timeout, not wait_for: no task per chunk
                async with asyncio.timeout(max(wait_s, 0.0)):
                    chunk = await inflight.chunks.get()
            except TimeoutError:
                inflight.fail(
                    f"no progress for {settings.progress_timeout_s:.0f} s"
                    if time.monotonic() < deadline_s
                    else f"not finished after {settings.request_timeout_s:.0f} s"
                )
                chunk = await inflight.chunks.get()
            yield chunk
            if chunk.finish_reason is not None:
                outcome = "error" if chunk.error else "success"
                return
    finally:
        dispatcher.finish(inflight, outcome)


async def _sse(
    chunks: AsyncIterator[ClientChunk], inflight: InflightRequest, writer: ChunkWriter
) -> AsyncIterator[str]:
    started = False
    if not writer.continuous_usage:
        # The role chunk at once, as OpenAI sends it (a client that leaves before the first
        # token is then seen leaving). Running usage needs the prompt's length, which the
        # first event brings: with continuous_usage_stats the chunk waits for it.
        started = True
        if opening := writer.start(0):
            yield opening
    pending_tokens = 0  # tokens whose text is still held back (stop strings)
    async for chunk in chunks:
        if not started:  # the prompt's length is known once the first event arrived
            started = True
            if opening := writer.start(inflight.num_prompt_tokens):
                yield opening
        if chunk.error:
            yield sse_error(chunk.error)
            break
        pending_tokens += chunk.num_tokens
        writer.num_cached_tokens = inflight.num_cached_tokens
        if chunk.text or chunk.finish_reason or chunk.logprobs:
            # where the request went and how long each stage took, for `epdctl bench`
            extra: dict[str, Any] = {
                "epd_path": list(inflight.path),
                "epd_stage_s": dict(inflight.stage_s),
            }
            yield writer.tokens(chunk.text, pending_tokens, chunk.finish_reason, chunk.logprobs,
                                **(extra if chunk.finish_reason else {}))  # fmt: skip
            pending_tokens = 0
    if totals := writer.usage(_usage(inflight)):
        yield totals
    yield SSE_DONE


def _usage(inflight: InflightRequest) -> Usage:
    return token_usage(
        inflight.num_prompt_tokens, len(inflight.token_ids), inflight.num_cached_tokens
    )
