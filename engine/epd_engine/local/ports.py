"""A free TCP port on the loopback interface, for a local process to listen on.

Chosen below the kernel's ephemeral range: ports there are handed out to every socket bound
to port 0 and to every outgoing connection -- the listening sockets gloo and NCCL open for a
tensor-parallel instance's ranks, its rendezvous store, any HTTP client -- so a port picked
from it can be taken by one of those before the process it was meant for binds it. That
happened: a P instance of two ranks failed to start with "address already in use" on the
port its launcher had picked, after its ranks' sockets had started.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 10000  # below: well-known and registered services
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_TRIES = 64
_RANDOM = random.SystemRandom()  # not the global generator: a test's seed would repeat picks


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where unreadable)."""
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, below the ephemeral range where it has room (else one the
    kernel picks). Another process may still take it before the caller binds it; local runs
    accept that small race (a clash fails the start loudly)."""
    high = ephemeral_low()
    for _ in range(_TRIES if high - LOWEST > 1000 else 0):
        port = _RANDOM.randrange(LOWEST, high)
        if _bindable(host, port):
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True
