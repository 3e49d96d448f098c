"""A small OpenAI-compatible streaming server with *known* latencies, for testing the driver.

Why a fixture and not our engine: the driver's job is to measure latency, so its tests need a
server whose TTFT and inter-token gaps are known exactly (first token after X s, then one every
Y s), that records every request as received (to check ``max_tokens``, ``ignore_eos`` and
images arrive as sent), that fails on demand (to check errors are counted, not crashed on) and
whose latency grows with load in a computable way (to check the goodput bisection lands on the
right rate). It speaks real HTTP + SSE on 127.0.0.1, so the real ``openai`` client is exercised.
Tests against the real engine live with the engine's own end-to-end tests.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class Behaviour:
    first_token_delay_s: float = 0.02  # after the request's service slot
    token_interval_s: float = 0.005
    service_s: float = 0.0  # FIFO "prefill" slot per request: queueing grows with load
    fail_max_tokens: int | None = None  # requests with this max_tokens get a 500
    drop_max_tokens: int | None = None  # ... or a stream cut after 2 tokens
    stage_s: dict[str, float] | None = None  # reported as epd_stage_s in the last chunk


@dataclass
class FakeOpenAI:
    behaviour: Behaviour = field(default_factory=Behaviour)
    requests: list[dict[str, Any]] = field(default_factory=list)
    url: str = ""

    def reset(self) -> None:
        self.behaviour = Behaviour()
        self.requests.clear()


def _chunk(content: str | None, finish: str | None = None, **extra: Any) -> str:
    body = {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": "fake-model",
        "choices": [
            {
                "index": 0,
                "delta": {"content": content, "role": "assistant"},
                "finish_reason": finish,
            }
        ],
        **extra,
    }
    return f"data: {json.dumps(body)}\n\n"


def create_app(state: FakeOpenAI) -> FastAPI:
    app = FastAPI()
    service_lock = asyncio.Lock()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> StreamingResponse | JSONResponse:
        body = await request.json()
        state.requests.append(body)
        b = state.behaviour
        max_tokens = int(body.get("max_tokens") or 16)
        if b.fail_max_tokens is not None and max_tokens == b.fail_max_tokens:
            error = {"message": "injected failure", "type": "server_error", "code": 500}
            return JSONResponse({"error": error}, status_code=500)

        async def stream() -> AsyncIterator[str]:
            yield _chunk("")  # role chunk before any token, as OpenAI does
            if b.service_s:
                async with service_lock:
                    await asyncio.sleep(b.service_s)
            await asyncio.sleep(b.first_token_delay_s)
            for i in range(max_tokens):
                if i:
                    await asyncio.sleep(b.token_interval_s)
                if b.drop_max_tokens is not None and max_tokens == b.drop_max_tokens and i == 2:
                    raise RuntimeError("injected connection drop")
                yield _chunk(f"t{i} ")
            extra = {"epd_stage_s": b.stage_s} if b.stage_s else {}
            yield _chunk(None, "length", **extra)
            usage = {"prompt_tokens": 1, "completion_tokens": max_tokens, "total_tokens": 1}
            last = {"id": "x", "object": "chat.completion.chunk", "created": 0}
            last |= {"model": "fake-model", "choices": [], "usage": usage}
            yield f"data: {json.dumps(last)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@contextmanager
def serve_fake_openai() -> Iterator[FakeOpenAI]:
    """Run the fake server in a background thread on a pre-bound 127.0.0.1 port."""
    state = FakeOpenAI()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(state), log_level="error", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("fake OpenAI server did not start")
        time.sleep(0.01)
    state.url = f"http://127.0.0.1:{port}/v1"
    try:
        yield state
    finally:
        server.should_exit = True
        thread.join(timeout=5)
        sock.close()
