"""A free TCP port on the loopback interface, for a local process to listen on."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel just found free on ``host``. Another process may take it before the
    caller binds it; local runs accept that small race (a clash fails the start loudly)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
