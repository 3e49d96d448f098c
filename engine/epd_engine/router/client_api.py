"""The router's public OpenAI surface: same request/response shapes as an instance."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from epd_engine.errors import ModelNotFound
from epd_engine.router.dispatch import Dispatcher
from epd_engine.router.inflight import ClientChunk, InflightRequest
from epd_engine.server.internal_api import require_token
from epd_engine.server.protocol import (
    SSE_DONE,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChunkChoice,
    Delta,
    Usage,
    chat_response,
    sse,
    sse_error,
    token_usage,
)

router = APIRouter()


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
    request: Request, since: float = 0.0, last: float | None = None
) -> StreamingResponse:
    """The live trace as JSONL: requests that arrived ``since`` seconds after router start, or
    (``last``) in the last that many seconds. Arrival times are seconds since router start;
    the ``X-EPD-Trace-Clock-S`` header is that clock now, so a caller knows the span covered."""
    dispatcher = _dispatcher(request)
    clock_s = time.monotonic() - dispatcher.started_s
    if last is not None:
        since = max(since, clock_s - last)
    records = dispatcher.recorder.since(since)
    lines = "".join(r.model_dump_json(exclude_none=True) + "\n" for r in records)
    return StreamingResponse(
        iter([lines]),
        media_type="application/x-ndjson",
        headers={TRACE_CLOCK_HEADER: f"{clock_s:.3f}"},
    )


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request
) -> ChatCompletionResponse | StreamingResponse:
    dispatcher = _dispatcher(request)
    served = dispatcher.settings.model
    if body.model != served:
        raise ModelNotFound(
            f"model {body.model!r} does not exist; this router serves {served!r}",
            param="model",
            code="model_not_found",
        )
    inflight = await dispatcher.start(body)
    chunks = _chunks(dispatcher, inflight)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _sse(chunks, inflight, include_usage), media_type="text/event-stream"
        )
    text = []
    finish: ClientChunk | None = None
    async for chunk in chunks:
        text.append(chunk.text)
        finish = chunk
    if finish is None or finish.error:
        raise RuntimeError(finish.error if finish else "request ended without output")
    return chat_response(
        inflight.router_request_id,
        body.model,
        "".join(text),
        finish.finish_reason,
        _usage(inflight),
    )


async def _chunks(dispatcher: Dispatcher, inflight: InflightRequest) -> AsyncIterator[ClientChunk]:
    """Chunks until the request finishes; a client that leaves counts as aborted."""
    outcome = "aborted"
    deadline = dispatcher.settings.request_timeout_s
    try:
        while True:
            try:  # asyncio.timeout, not wait_for: no task per chunk
                async with asyncio.timeout(deadline):
                    chunk = await inflight.chunks.get()
            except TimeoutError:
                inflight.fail(f"no progress for {deadline:.0f} s")
                chunk = await inflight.chunks.get()
            yield chunk
            if chunk.finish_reason is not None:
                outcome = "error" if chunk.error else "success"
                return
    finally:
        dispatcher.finish(inflight, outcome)


async def _sse(
    chunks: AsyncIterator[ClientChunk], inflight: InflightRequest, include_usage: bool
) -> AsyncIterator[str]:
    model = inflight.body.model

    def event(delta: Delta, finish: str | None = None, usage: Usage | None = None) -> str:
        choices = [] if usage else [ChunkChoice(delta=delta, finish_reason=finish)]
        body = ChatCompletionChunk(
            id=inflight.router_request_id, model=model, choices=choices, usage=usage
        )
        if finish is not None:
            body.epd_path = list(inflight.path)
            body.epd_stage_s = dict(inflight.stage_s)
        return sse(body)

    yield event(Delta(role="assistant", content=""))
    async for chunk in chunks:
        if chunk.error:
            yield sse_error(chunk.error)
            break
        if chunk.text or chunk.finish_reason:
            yield event(Delta(content=chunk.text or None), chunk.finish_reason)
    if include_usage:
        yield event(Delta(), usage=_usage(inflight))
    yield SSE_DONE


def _usage(inflight: InflightRequest) -> Usage:
    return token_usage(inflight.num_prompt_tokens, len(inflight.token_ids))
