"""Start real server processes on 127.0.0.1 for end-to-end tests, and stop them for sure."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

from epd_engine.local.ports import free_port as free_port  # the tests' one port helper
from epd_engine.local.spawn import ChildProcess, spawn_epdctl

EPDCTL = [sys.executable, "-m", "epd_engine"]


def wait_ready(url: str, proc: ChildProcess, log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout_s}s:\n{log.read_text()[-3000:]}")


@contextmanager
def running(
    args: Sequence[str], ready_url: str, log: Path, env: dict[str, str] | None = None
) -> Iterator[ChildProcess]:
    """Run ``epdctl ARGS`` until the block ends; its output goes to ``log``."""
    with log.open("wb") as out:
        proc = spawn_epdctl(args, out, {**os.environ, **(env or {})})
    try:
        wait_ready(ready_url, proc, log)
        yield proc
    finally:
        stop(proc)


def stop(proc: ChildProcess, timeout_s: float = 15) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def rank_pids(leader: int | None = None) -> list[int]:
    """Tensor-parallel rank processes on this host (``parallel/rank_main.py``), those one
    ``leader`` started when given (their command line names its pid)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"epd_engine.parallel.rank_main" not in argv:
            continue
        if leader is None or argv[-2:-1] == [str(leader).encode()]:
            found.append(int(entry.name))
    return found
