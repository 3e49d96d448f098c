"""A real router app served by uvicorn on loopback inside the test's event loop (so a test
can look at its requests in flight), and a TCP proxy in front of it that a test can cut."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI

from epd_engine.api.protocol import ChatCompletionRequest
from epd_engine.router.app import create_app
from epd_engine.router.dispatch import Dispatcher
from epd_engine.router.inflight import InflightRequest
from epd_engine.router.settings import RouterSettings
from tests.processes import free_port


@asynccontextmanager
async def live_router(
    port: int | None = None, **settings: object
) -> AsyncIterator[tuple[str, FastAPI]]:
    app = create_app(RouterSettings(model="tiny-llava", **settings))  # type: ignore[arg-type]
    port = port or free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=5
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()  # start-up failed: raise why
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        await task


def dispatcher(app: FastAPI) -> Dispatcher:
    result: Dispatcher = app.state.dispatcher
    return result


def track(app: FastAPI, router_request_id: str) -> InflightRequest:
    """Register a request in flight, as ``Dispatcher.start`` does before submitting it."""
    body = ChatCompletionRequest.model_validate(
        {"model": "tiny-llava", "messages": [{"role": "user", "content": "hi"}]}
    )
    request = InflightRequest(router_request_id, body, 0.0)
    dispatcher(app).inflight[router_request_id] = request
    return request


async def wait_for_tokens(request: InflightRequest, count: int, timeout_s: float = 30) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while len(request.token_ids) < count and not request.finished:
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"{len(request.token_ids)} of {count} tokens arrived")
        await asyncio.sleep(0.01)


class TcpProxy:
    """Forwards loopback connections to ``target_port``; ``cut`` resets every open one and
    ``close``/``open`` take the listening port away and back (the router unreachable)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.num_connections = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def open(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        self.cut()

    def cut(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers |= {writer, up_writer}
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    writer.transport.abort()  # one side gone: the other goes too, as a reset


class SilentInstance:
    """Stands in for an engine instance that takes requests and then never says anything
    (a frozen process): answers every POST with 200 and records its path. A real instance
    cannot be made to freeze at a chosen point from inside a test."""

    def __init__(self) -> None:
        self.port = free_port()
        self.paths: list[str] = []
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> SilentInstance:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.paths.append(head.split(b" ")[1].decode())
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                body = b'{"request_id": "r", "prompt_tokens": 1, "images": []}'
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
