"""Start the source processes ``bench-transfer`` and ``profile-costs`` pull from: one
``transfer_peer`` per backend (caches of a given shape, seeded pages, the real backend and
its HTTP control routes) and one ``link_peer`` (the raw limits). All start together, since
each spends seconds importing torch, and all are stopped (process group) on the way out.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from epd_engine.bench.transfer_peer import CacheSpec
from epd_engine.local.ports import free_port
from epd_engine.transfer.backend import Peer

TOKEN = "bench-token"
READY_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Sources:
    peers: dict[str, Peer]  # backend name -> the page source serving it
    link_port: int  # the link_peer's port (raw socket and gloo limits); 0 without one


@dataclass
class _Started:
    name: str
    popen: subprocess.Popen[bytes]
    port: int
    log: Path


def _start(name: str, args: Sequence[str], port: int, log_dir: Path) -> _Started:
    log = log_dir / f"{name}.log"
    with log.open("wb") as out:
        popen = subprocess.Popen(
            [sys.executable, "-m", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopped as one
        )
    return _Started(name, popen, port, log)


def _wait(started: _Started, ready: bool) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if started.popen.poll() is not None:
            tail = started.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{started.name} exited with {started.popen.returncode}:\n{tail}")
        with contextlib.suppress(OSError, httpx.HTTPError):
            if not ready:  # the link peer speaks raw TCP: accepting is ready
                socket.create_connection(("127.0.0.1", started.port), timeout=1).close()
                return
            if httpx.get(f"http://127.0.0.1:{started.port}/ready", timeout=1).status_code == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(f"{started.name} not ready after {READY_TIMEOUT_S:.0f}s ({started.log})")


def _stop(popen: subprocess.Popen[bytes]) -> None:
    if popen.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(popen.pid, signal.SIGTERM)
    try:
        popen.wait(10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGKILL)
        popen.wait()


@contextlib.contextmanager
def sources(
    spec: CacheSpec,
    backends: Sequence[str],
    log_dir: Path,
    seed: int = 0,
    link_peer: bool = True,
    device: str = "cpu",
) -> Iterator[Sources]:
    """A page source per backend (and the link peer, unless ``link_peer`` is False), its
    caches on ``device``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    started: list[_Started] = []
    try:
        for name in backends:
            port = free_port()
            args = ["epd_engine.bench.transfer_peer", "--backend", name, "--port", str(port),
                    "--seed", str(seed), "--token", TOKEN, "--device", device,
                    *spec.to_args()]  # fmt: skip
            started.append(_start(f"source-{name}", args, port, log_dir))
        link_port = 0
        if link_peer:
            link_port = free_port()
            link = _start("link-peer", ["epd_engine.bench.link_peer", "--port", str(link_port)],
                          link_port, log_dir)  # fmt: skip
            started.append(link)
        peers = {}
        for name, s in zip(backends, started, strict=False):
            _wait(s, ready=True)
            url = f"http://127.0.0.1:{s.port}"
            descriptor = httpx.get(f"{url}/describe", timeout=10).json()
            peers[name] = Peer(f"source-{name}-{s.popen.pid}", url, descriptor)
        if link_peer:
            _wait(started[-1], ready=False)
        yield Sources(peers, link_port)
    finally:
        for s in started:
            _stop(s.popen)


def expose(peer: Peer, kind: str, pages: Sequence[int], request_id: str) -> None:
    """Make ``pages`` pullable for ``request_id`` (a source serves only exposed pages)."""
    body = {"kind": kind, "pages": list(pages), "request_id": request_id}
    httpx.post(f"{peer.url}/expose", json=body, timeout=10).raise_for_status()
