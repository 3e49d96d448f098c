"""A free TCP port on the loopback interface, for a local process to listen on.

Chosen below the kernel's ephemeral range: ports there are handed out to every socket bound
to port 0 and to every outgoing connection -- the listening sockets gloo and NCCL open for a
tensor-parallel instance's ranks, its rendezvous store, any HTTP client -- so a port picked
from it can be taken by one of those before the process it was meant for binds it. That
happened: a P instance of two ranks failed to start with "address already in use" on the
port its launcher had picked, after its ranks' sockets had started.

A picked port is also *claimed* for a while (a file in a directory every picker on the
machine shares), because the process it is meant for binds it only seconds later, once it
has imported torch. Two launchers picking in that window -- two ``epdctl up`` runs, or the
two test suites CI runs side by side -- could otherwise both be handed the same free port:
that happened in CI, an engine of one system failing to bind the port another system's
launcher had picked a moment before.
"""

from __future__ import annotations

import os
import random
import socket
import tempfile
import time
from pathlib import Path

LOWEST = 10000  # below: well-known and registered services
CLAIM_S = 300.0  # a claim outlives the slowest start we have seen (an engine on a loaded host)
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_TRIES = 64
_RANDOM = random.SystemRandom()  # not the global generator: a test's seed would repeat picks


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where unreadable)."""
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def claims_dir() -> Path:
    """Where every picker on this machine records its recent picks (per user: a claim is a
    courtesy between our own launchers, not a lock against other programs)."""
    override = os.environ.get("EPD_PORT_CLAIMS_DIR")
    return Path(override) if override else Path(tempfile.gettempdir()) / f"epd-ports-{os.getuid()}"


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now and not picked by another launcher in the last
    ``CLAIM_S`` seconds, below the ephemeral range where it has room (else one the kernel
    picks). Another program may still take it before the caller binds it; local runs accept
    that small race (a clash fails the start loudly)."""
    high = ephemeral_low()
    for _ in range(_TRIES if high - LOWEST > 1000 else 0):
        port = _RANDOM.randrange(LOWEST, high)
        if _bindable(host, port) and _claim(port):
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


def _claim(port: int) -> bool:
    """Record the pick; False if another picker holds a live claim on the port. An
    unwritable claims directory claims nothing and refuses nothing."""
    folder = claims_dir()
    path = folder / str(port)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if _expired(path):
            path.unlink(missing_ok=True)
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    except OSError:
        return True
    return True


def _expired(path: Path) -> bool:
    try:
        return time.time() - path.stat().st_mtime > CLAIM_S
    except FileNotFoundError:
        return False
