"""Start ``python -m epd_engine ARGS`` as a supervised child, through the zygote when it can.

Every local launcher (``epdctl up``'s pools, the measured static system, the tests' servers)
starts engine processes here. The child is in its own session (``down`` and the tests stop it
with ``killpg``), writes stdout and stderr to ``out``, and is handed back as an object with
the part of ``subprocess.Popen``'s interface launchers use (``ChildProcess``).

Instances (``serve``, real or ``--emulate``) go through a zygote of their kind
(``local/zygote.py``); ``EPD_ZYGOTE=0`` turns them off (every spawn a fresh interpreter).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any, Protocol


class ChildProcess(Protocol):
    """What launchers use of a child: ``subprocess.Popen`` and ``ZygoteChild`` both have it."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | Any: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


def spawn_epdctl(args: Sequence[str], out: IO[bytes], env: Mapping[str, str]) -> ChildProcess:
    """``python -m epd_engine ARGS`` in its own session, output to ``out``, environment ``env``."""
    kind = _zygote_kind(args)
    zygote = _zygote_for(kind, env) if kind is not None else None
    if zygote is not None:
        child = zygote.spawn(list(args), out.fileno(), dict(env))
        if child is not None:
            return child
    return subprocess.Popen(
        [sys.executable, "-m", "epd_engine", *args],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=dict(env),
        start_new_session=True,
    )


def _zygote_kind(args: Sequence[str]) -> str | None:
    """Which zygote (``zygote.PRELOAD``) holds what ``args`` imports: a real engine's, or an
    emulated one's (which must not map torch: it stays small); other commands start afresh."""
    if not args or args[0] != "serve":
        return None
    return "emulated" if "--emulate" in args else "engine"


class ZygoteChild:
    """A child the zygote forked; its exit status arrives from the zygote."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self.zygote = zygote
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_of(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self.zygote.wait_for_exits(min(left, 0.5) if left is not None else 0.5)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The launcher's end of one zygote process (``epd_engine.local.zygote``)."""

    def __init__(self, kind: str = "engine") -> None:
        ours, theirs = socket.socketpair()
        self.env = dict(os.environ)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "epd_engine.local.zygote", str(theirs.fileno()), kind],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C is for the launcher; the zygote ends at EOF
        )
        theirs.close()
        self.sock = ours
        self.reader = ours.makefile("rb")
        self.lock = threading.Lock()  # one spawn at a time: each waits for its pid
        self.changed = threading.Condition()
        self.exits: dict[int, int] = {}
        self.pids: list[int] = []
        self.alive = True
        ready = self._read()
        if not ready or ready.get("python_threads") != 1:  # forking a running thread is unsafe
            raise RuntimeError(f"zygote did not start cleanly: {ready}")
        threading.Thread(target=self._read_exits, name="zygote-exits", daemon=True).start()

    def spawn(self, args: list[str], out_fd: int, env: dict[str, str]) -> ZygoteChild | None:
        request = {"argv": args, "env": env, "cwd": os.getcwd()}
        with self.lock, self.changed:
            if not self.alive:
                return None
            socket.send_fds(self.sock, [json.dumps(request).encode() + b"\n"], [out_fd])
            while self.alive and not self.pids:
                self.changed.wait(1.0)
            if not self.pids:
                return None
            return ZygoteChild(self, self.pids.pop(0), args)

    def close(self) -> None:
        """End the zygote (EOF on its socket) and reap it. Its children live on as they
        would have without it. Called at the launcher's exit: an unreaped zygote would
        stay a zombie where PID 1 does not reap orphans (a container's shell)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def exit_of(self, pid: int) -> int | None:
        with self.changed:
            if pid in self.exits:
                return self.exits[pid]
            if not self.alive and not os.path.exists(f"/proc/{pid}"):
                return -signal.SIGKILL  # the zygote died first; its exit status is lost
            return None

    def wait_for_exits(self, timeout_s: float) -> None:
        with self.changed:
            self.changed.wait(timeout_s)

    def _read(self) -> dict[str, Any] | None:
        line = self.reader.readline()
        return json.loads(line) if line else None

    def _read_exits(self) -> None:
        while (message := self._read()) is not None:
            with self.changed:
                if "pid" in message:
                    self.pids.append(int(message["pid"]))
                else:
                    self.exits[int(message["exit"])] = int(message["returncode"])
                self.changed.notify_all()
        with self.changed:
            self.alive = False
            self.changed.notify_all()


_zygotes: dict[str, Zygote] = {}  # this process's, by kind
_failed: set[str] = set()  # kinds whose zygote failed once: not paid again per spawn
_zygote_lock = threading.Lock()


def _zygote_for(kind: str, env: Mapping[str, str]) -> Zygote | None:
    """This process's zygote of ``kind``, if ``env`` lets a fork of it stand for a fresh
    interpreter."""
    if os.environ.get("EPD_ZYGOTE", "1") == "0" or kind in _failed:
        return None
    with _zygote_lock:
        zygote = _zygotes.get(kind)
        if zygote is None or not zygote.alive:
            try:
                if not _zygotes:
                    atexit.register(_close_zygotes)
                zygote = _zygotes[kind] = Zygote(kind)
            except (OSError, RuntimeError) as exc:
                _failed.add(kind)
                print(f"epdctl: no {kind} zygote, each starts afresh: {exc}", file=sys.stderr)
                return None
    return zygote if fork_stands_for_exec(env, zygote.env) else None


def _close_zygotes() -> None:
    for zygote in _zygotes.values():
        zygote.close()


def fork_stands_for_exec(env: Mapping[str, str], zygote_env: Mapping[str, str]) -> bool:
    """A child may be forked if its environment differs from the zygote's in ``EPD_*`` alone:
    ours are read when used, others (threads, CUDA, allocators) when torch is imported.
    (``PYTEST_CURRENT_TEST``, which pytest changes per test, is read by nothing imported.)"""
    differing = {k for k in env.keys() | zygote_env.keys() if env.get(k) != zygote_env.get(k)}
    return all(k.startswith("EPD_") or k == "PYTEST_CURRENT_TEST" for k in differing)
