"""The emulated instance's public routes: ``/v1/models`` and ``/v1/chat/completions`` in the
shapes the engine answers (``api/protocol.py``, ``api/streaming.py``), with emulated text."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from epd_engine.api.protocol import (
    SSE_DONE,
    ChatCompletionRequest,
    chat_response,
    json_answer,
    token_usage,
)
from epd_engine.api.streaming import ChunkWriter
from epd_engine.api.validation import check_chat_request, check_role_serves
from epd_engine.config import SLO
from epd_engine.contracts.errors import ClientError, ModelNotFound
from epd_engine.disagg.router_link import RouterLink
from epd_engine.emulate import EMULATED_NOTE
from epd_engine.emulate.http import route
from epd_engine.emulate.loop import EmulatedLoop
from epd_engine.emulate.prompts import chat_request
from epd_engine.emulate.tokens import token_text
from epd_engine.metrics import Metrics
from epd_engine.request import Request as EngineRequest
from epd_engine.scheduler import RequestEvent

if TYPE_CHECKING:
    from epd_engine.emulate.migration import EmulatedMigration


@dataclass
class EmulatedState:
    model_name: str  # always ends in EMULATED_SUFFIX
    loop: EmulatedLoop
    metrics: Metrics
    slo: SLO
    ready: bool = False
    link: RouterLink | None = None  # set: registered with a router, serving its requests
    relays: dict[str, asyncio.Task[None]] = field(default_factory=dict)  # router requests
    migration: EmulatedMigration | None = None  # behind a router: hands requests on, takes them


def _state(request: Request) -> EmulatedState:
    state: EmulatedState = request.app.state.emulated
    return state


async def list_models(request: Request) -> dict[str, object]:
    state = _state(request)
    capacity = state.loop.engine.capacity
    model = {
        "id": state.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "epd-emulated",
        "max_model_len": capacity.max_model_len,
        "emulated": True,
        "note": EMULATED_NOTE,
    }
    return {"object": "list", "data": [model]}


async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
    state = _state(request)
    if body.model != state.model_name:
        raise ModelNotFound(
            f"model {body.model!r} does not exist; this emulated server serves "
            f"{state.model_name!r}",
            param="model",
            code="model_not_found",
        )
    if not state.ready:
        raise ClientError("server is starting", code="not_ready")
    check_chat_request(body)
    check_role_serves(state.loop.engine.role, body.num_images() > 0)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    engine_request = chat_request(request_id, body, state.loop.engine.tokens_per_image)
    events = state.loop.generate(engine_request)
    timer = _Timer(state)
    try:
        first = await anext(events)  # admission errors become a 400 before any byte is sent
    except ValueError as exc:
        raise ClientError(str(exc)) from exc
    if body.stream:
        writer = ChunkWriter("chat", request_id, body.model, body.stream_options)
        stream = _sse(first, events, writer, engine_request, timer)
        return StreamingResponse(stream, media_type="text/event-stream")
    texts = [token_text(first.new_token_id)] if first.new_token_id is not None else []
    timer.token()
    final = first
    async for event in events:
        timer.token()
        if event.new_token_id is not None:
            texts.append(token_text(event.new_token_id))
        final = event
    timer.finish()
    usage = token_usage(engine_request.num_prompt_tokens, len(texts))
    answer = chat_response(request_id, body.model, "".join(texts), final.finish_reason, usage)
    return json_answer(answer)


ROUTES: list[Route] = [
    route("/v1/models", list_models),
    route("/v1/chat/completions", chat_completions, "POST", body=ChatCompletionRequest),
]


async def _sse(
    first: RequestEvent,
    events: AsyncIterator[RequestEvent],
    writer: ChunkWriter,
    request: EngineRequest,
    timer: _Timer,
) -> AsyncIterator[str]:
    if (opening := writer.start(request.num_prompt_tokens)) is not None:
        yield opening
    event: RequestEvent | None = first
    while event is not None:
        timer.token()
        text = token_text(event.new_token_id) if event.new_token_id is not None else ""
        yield writer.tokens(text, int(event.new_token_id is not None), event.finish_reason)
        event = await anext(events, None)
    timer.finish()
    usage = token_usage(request.num_prompt_tokens, writer.num_output_tokens)
    if (closing := writer.usage(usage)) is not None:
        yield closing
    yield SSE_DONE


class _Timer:
    """TTFT / TPOT of one request as this server saw them (the same histograms as the
    engine's, under the emulated model name)."""

    def __init__(self, state: EmulatedState) -> None:
        self.state = state
        self.start_s = time.monotonic()
        self.token_times_s: list[float] = []

    def token(self) -> None:
        self.token_times_s.append(time.monotonic())

    def finish(self) -> None:
        metrics = self.state.metrics
        metrics.requests.labels(**metrics.labels, outcome="success").inc()
        times = self.token_times_s
        if times:
            gaps = [b - a for a, b in itertools.pairwise(times)]
            metrics.observe_tokens(times[0] - self.start_s, gaps, self.state.slo, success=True)
