"""The router keeps an idle client connection open longer than clients pool one.

Defect: uvicorn's default closed a connection idle for 5 s, the time httpx (the openai SDK's
transport) keeps one pooled, so a request sent on a pooled connection as the router closed
it failed with "Server disconnected without sending a response" (seen in CI under load as
``httpx.RemoteProtocolError`` in test_methods). Here a connection idle for 6 s is still
served. The real ``epdctl router`` process on loopback; the client is a raw socket, so the
test sees exactly what the server does with the connection."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from tests.processes import free_port, running

REQUEST = b"GET /health/live HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: keep-alive\r\n\r\n"


def _exchange(sock: socket.socket) -> bytes:
    """One request and its whole response (headers, then content-length bytes of body)."""
    sock.sendall(REQUEST)
    answer = b""
    while b"\r\n\r\n" not in answer or len(answer) < _length(answer):
        chunk = sock.recv(4096)
        if not chunk:
            return answer  # the server closed the connection
        answer += chunk
    return answer


def _length(answer: bytes) -> int:
    """The response's whole length once its headers are in."""
    head, _, _ = answer.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(head) + 4 + int(value)
    return len(head) + 4


@pytest.mark.slow
def test_a_connection_idle_past_the_clients_pool_time_is_still_served(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["router", "--model", "m", "--host", "127.0.0.1", "--port", str(port)]
    env = {"EPD_INTERNAL_TOKEN": "keep-alive-test"}
    with (
        running(args, f"{url}/health/live", tmp_path / "router.log", env=env),
        socket.create_connection(("127.0.0.1", port), timeout=10) as sock,
    ):
        assert _exchange(sock).startswith(b"HTTP/1.1 200")
        time.sleep(6.0)  # past uvicorn's default 5 s and httpx's 5 s pool expiry
        assert _exchange(sock).startswith(b"HTTP/1.1 200"), "the idle connection was closed"
