"""The two halves of an HTTP/1.1 client exchange both hand-written clients share.

The router's kept-alive POST and an instance's chunked POST each drive h11 themselves (for
speed, see their modules); opening the socket and reading the answer are the same in both.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import NamedTuple
from urllib.parse import urlsplit

import h11


class Target(NamedTuple):
    host: str
    port: int
    https: bool
    netloc: str  # the Host header
    path: str  # the request target: path and query


def parse_target(url: str) -> Target:
    parts = urlsplit(url)
    https = parts.scheme == "https"
    port = parts.port or (443 if https else 80)
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    return Target(parts.hostname or "", port, https, parts.netloc, path)


async def connect(
    host: str, port: int, https: bool, timeout_s: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    context = ssl.create_default_context() if https else None
    return await asyncio.wait_for(asyncio.open_connection(host, port, ssl=context), timeout_s)


async def read_answer(
    connection: h11.Connection, reader: asyncio.StreamReader, peer: str
) -> tuple[int, bytes]:
    """The status and whole body of the answer; ConnectionError if ``peer`` cut it short."""
    status = 0
    body = bytearray()
    while True:
        event = connection.next_event()
        if event is h11.NEED_DATA:  # b"" at the end: h11 tells a whole answer from a cut one
            connection.receive_data(await reader.read(65536))
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return status, bytes(body)
        elif isinstance(event, h11.ConnectionClosed):
            raise ConnectionError(f"the {peer} closed the connection before answering")
