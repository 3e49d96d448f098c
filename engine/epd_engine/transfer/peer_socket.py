"""Small blocking-socket helpers the byte-moving backends share: JSON header lines, exact
reads into caller memory, a token handshake, liveness checks."""

from __future__ import annotations

import hmac
import json
import select
import socket
from typing import Any

from epd_engine.transfer.backend import TransferError

MAX_HEADER_BYTES = 64 << 10  # a header names pages; 64 KiB is thousands of them


def send_json(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message, separators=(",", ":")).encode() + b"\n")


def recv_json(reader: LineReader) -> dict[str, Any]:
    line = reader.readline()
    try:
        message = json.loads(line)
    except ValueError as exc:
        raise TransferError(f"malformed header from peer: {line[:80]!r}") from exc
    if not isinstance(message, dict):
        raise TransferError("a transfer header must be a JSON object")
    return message


class LineReader:
    """Reads ``\\n``-terminated headers, then hands raw bytes over without extra copies."""

    def __init__(self, sock: socket.socket, received: bytes = b"") -> None:
        self.sock = sock
        self._buffer = bytearray(received)  # bytes already read off the socket

    def readline(self) -> bytes:
        while b"\n" not in self._buffer:
            if len(self._buffer) > MAX_HEADER_BYTES:
                raise TransferError("transfer header too long")
            chunk = self.sock.recv(65536)
            if not chunk:
                raise TransferError("peer closed the connection")
            self._buffer += chunk
        line, _, rest = bytes(self._buffer).partition(b"\n")
        self._buffer = bytearray(rest)
        return line

    def read_into(self, view: memoryview) -> None:
        """Fill ``view`` exactly: first from what the header read left over, then the socket."""
        filled = min(len(self._buffer), len(view))
        if filled:
            view[:filled] = self._buffer[:filled]
            del self._buffer[:filled]
        while filled < len(view):
            n = self.sock.recv_into(view[filled:])
            if n == 0:
                raise TransferError("peer closed the connection mid-transfer")
            filled += n


def check_token(offered: object, token: str) -> bool:
    return isinstance(offered, str) and hmac.compare_digest(offered.encode(), token.encode())


def peer_closed(sock: socket.socket) -> bool:
    """True when the other end has gone (EOF or error pending), without blocking."""
    try:
        readable, _, errored = select.select([sock], [], [sock], 0)
        if errored:
            return True
        if readable:
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (OSError, ValueError):
        return True
    return False
