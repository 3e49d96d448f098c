"""Request body size, refused before the body is read (router and instances).

A 60 MB text body once drove an instance from 0.76 GB to 16 GB and stalled the router's
event loop until it dropped every instance. A declared ``Content-Length`` over the limit is
refused at once; a chunked body is counted as it arrives and refused at the limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from epd_engine.api.error_shape import error_body
from epd_engine.contracts.errors import ClientError

DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024  # a few base64 images of the default size
# Internal routes are token-only and carry long streams (the event stream) and bodies the
# router has already limited.
EXEMPT_PREFIX = "/internal/"
DISCARD_BYTES = 256 * 1024 * 1024
DISCARD_S = 10.0


class RequestTooLarge(ClientError):
    status_code = 413


class BodySizeLimit:
    """ASGI middleware: 413 for a body over ``max_bytes`` without reading past the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith(EXEMPT_PREFIX):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._discard(receive, int(declared))
            await self._refuse(send)
            return
        received = 0
        refused = False

        async def counted() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # answer now; the app sees a client that left and its answer goes nowhere
                    if message.get("more_body"):
                        await self._discard(receive, DISCARD_BYTES)
                    await self._refuse(send)
                    refused = True
                    return {"type": "http.disconnect"}
            return message

        async def guarded(message: Message) -> None:
            if not refused:
                await send(message)

        await self.app(scope, counted, guarded)

    def error(self) -> RequestTooLarge:
        return RequestTooLarge(
            f"request body is larger than {self.max_bytes} bytes", code="request_too_large"
        )

    @staticmethod
    async def _discard(receive: Receive, size: int) -> None:
        """Read and drop what the client is still sending (nothing kept), so it gets to read
        our 413 instead of a reset: most clients send the whole body before reading. Past
        ``DISCARD_BYTES`` or ``DISCARD_S`` the connection is simply closed."""
        if size > DISCARD_BYTES:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(DISCARD_S):
                while True:
                    message = await receive()
                    if message["type"] != "http.request" or not message.get("more_body"):
                        return

    async def _refuse(self, send: Send) -> None:
        error = self.error()
        body = json.dumps(error_body(error.message, error.error_type, None, error.code)).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
