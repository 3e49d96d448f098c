"""Remote image URLs cannot reach the private network, nor hold the encoder (issue 12).

Against real HTTP servers on loopback. Loopback is itself refused, so the download tests
(size cap, dripping server, upstream errors) pass a ``refuse`` check that lets 127.0.0.1
through: the public internet a real image host would be on does not exist here.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest

from epd_engine.contracts.errors import ClientError
from epd_engine.inputs.remote_images import RemoteImagePolicy, fetch_image, is_internal


@asynccontextmanager
async def server(handler) -> AsyncIterator[int]:  # type: ignore[no-untyped-def]
    """A raw HTTP/1.1 server on loopback; ``handler(writer)`` writes the answer."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        try:
            await handler(writer)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    listener = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield listener.sockets[0].getsockname()[1]
    finally:
        listener.close()


def loopback_ok(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    return not address.is_loopback and is_internal(address)


def policy(**overrides: object) -> RemoteImagePolicy:
    values: dict[str, object] = {
        "allowed_hosts": ("*",),
        "max_bytes": 1000,
        "read_timeout_s": 0.5,
        "total_timeout_s": 2.0,
    }
    values.update(overrides)
    return RemoteImagePolicy(**values)  # type: ignore[arg-type]


async def refused(url: str, p: RemoteImagePolicy, **kwargs: object) -> str:
    async with httpx.AsyncClient() as http:
        with pytest.raises(ClientError) as caught:
            await fetch_image(url, p, http, **kwargs)  # type: ignore[arg-type]
    assert caught.value.status_code == 400
    return caught.value.message


async def test_remote_urls_are_off_by_default() -> None:
    message = await refused("http://example.com/cat.png", RemoteImagePolicy())
    assert "remote image URLs are off" in message


async def test_host_outside_the_allow_list_is_refused() -> None:
    message = await refused("http://evil.test/x.png", policy(allowed_hosts=(".example.com",)))
    assert "not allowed" in message


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data",  # cloud metadata (link-local)
        "http://127.0.0.1:8080/internal/pools",  # the router's own routes
        "http://localhost/x.png",  # a name that resolves to loopback
        "http://10.0.0.1/x.png",
        "http://[::1]/x.png",
        "http://[::ffff:127.0.0.1]/x.png",  # loopback behind an IPv4-mapped IPv6 address
        "http://0.0.0.0/x.png",
    ],
)
async def test_private_loopback_and_link_local_are_refused_after_resolution(url: str) -> None:
    """The encoder fetched the metadata service and loopback listeners for any client."""
    message = await refused(url, policy())
    assert "does not fetch" in message


async def test_an_oversized_image_is_cut_while_streaming() -> None:
    """A 200 MB image was downloaded whole before the size check."""
    sent = 0

    async def endless(writer: asyncio.StreamWriter) -> None:  # no Content-Length
        nonlocal sent
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
        while sent < 10_000_000:
            writer.write(b"x" * 4096)
            sent += 4096
            await writer.drain()

    async with server(endless) as port:
        message = await refused(f"http://127.0.0.1:{port}/big", policy(), refuse=loopback_ok)
    assert "larger than 1000 bytes" in message
    assert sent < 10_000_000


async def test_a_dripping_server_is_given_up_on() -> None:
    """A server dripping a byte every 2 s held the encoder after the router gave up."""

    async def drip(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
        for _ in range(100):
            writer.write(b"x")
            await writer.drain()
            await asyncio.sleep(0.3)  # each read is in time, the whole is not

    async with server(drip) as port:
        started = asyncio.get_running_loop().time()
        message = await refused(
            f"http://127.0.0.1:{port}/slow", policy(total_timeout_s=1.0), refuse=loopback_ok
        )
        elapsed = asyncio.get_running_loop().time() - started
    assert "timed out" in message
    assert elapsed < 3


async def test_upstream_answers_are_not_echoed() -> None:
    async def secret(writer: asyncio.StreamWriter) -> None:
        body = b"ami-id secret-token"
        writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 19\r\n\r\n" + body)
        await writer.drain()

    async with server(secret) as port:
        message = await refused(f"http://127.0.0.1:{port}/x", policy(), refuse=loopback_ok)
    assert message == "cannot fetch the image from '127.0.0.1'"


async def test_an_allowed_image_is_fetched() -> None:
    async def ok(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
        await writer.drain()

    async with server(ok) as port, httpx.AsyncClient() as http:
        data = await fetch_image(f"http://127.0.0.1:{port}/x", policy(), http, loopback_ok)
    assert data == b"hello"
