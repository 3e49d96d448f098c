"""Start local engine processes by forking a warm process: torch and transformers load once.

(An emulated instance's zygote holds FastAPI and the emulator instead: its forks start in a
fraction of a second, where a fresh interpreter takes ~1.1 CPU-s, most of it imports.)

Why: most of a tiny instance's start is imports (torch ~2.5 CPU-s, transformers with the
``torch._dynamo`` its processors pull in ~4 CPU-s; measured with ``time.process_time`` and
py-spy). Every local deployment, scale-up and test paid them per process; a fork of a process
that already holds them pays none (``make bench-engine-start``: 3.2 vs 13.4 CPU-s a start).
Android's zygote and multiprocessing's forkserver do the same.

The zygote is one process per launcher (started at its first spawn, gone when the launcher
is). It imports the engine's heavy modules, then waits on a socket. For each spawn it forks;
the child becomes what ``python -m epd_engine ARGS`` would have been (its own session, the
given environment, stdout and stderr to the given file) and the zygote reports its pid, then
its exit status when it ends. The zygote runs no Python thread and never touches a device, so
its fork is as safe as a DataLoader worker's (torch's import leaves one idle native thread;
no CUDA context is copied).

Only a spawn whose environment differs from the zygote's in ``EPD_*`` variables alone goes
through it (``spawn.fork_stands_for_exec``): torch and its libraries read other variables
(threads, CUDA, allocators) when imported, and a child must see its own. Anything else is a
plain ``subprocess.Popen``.
"""

from __future__ import annotations

import importlib
import json
import os
import selectors
import signal
import socket
import sys
import threading
from typing import Any

import setproctitle

# What each kind of child imports before it serves: a real engine (`epdctl serve`: torch,
# the server, transformers' processor machinery with torch._dynamo) or an emulated one
# (`serve --emulate`: FastAPI and the emulator, no torch, so its children stay small).
PRELOAD = {
    "engine": (
        "torch",
        "uvicorn",
        "epd_engine.server.app",
        "epd_engine.server.drain",
        "epd_engine.model.loader",
        "epd_engine.transfer.factory",
        "transformers.processing_utils",
        "transformers.models.auto.processing_auto",
    ),
    "emulated": ("uvicorn", "epd_engine.emulate.serve"),
}


def serve(sock: socket.socket) -> None:
    """The zygote's loop: fork for each request on ``sock``; report pids and exits."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd is written
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ, "request")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    buffer = b""
    while True:
        for key, _ in selector.select():
            if key.data == "child":
                os.read(wake_r, 4096)
                _report_exits(sock)
                continue
            data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 4)
            if not data:  # the launcher is gone
                return
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                pid = _fork(json.loads(line), fds, sock, (wake_r, wake_w))
                for fd in fds:
                    os.close(fd)
                fds = []
                _send(sock, {"pid": pid})


def _fork(
    request: dict[str, Any], fds: list[int], sock: socket.socket, keep: tuple[int, int]
) -> int:
    """In the zygote: the child's pid. In the child: run ``epdctl ARGV``, then exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sock.close()
        for fd in keep:
            os.close(fd)
        os.setsid()
        out = fds[0]
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(devnull)
        os.close(out)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        argv = list(request["argv"])
        sys.argv = ["epdctl", *argv]
        # as `ps` would show a fresh one (one string: argv cannot grow in place)
        setproctitle.setproctitle(" ".join([sys.executable, "-m", "epd_engine", *argv]))
        from epd_engine.cli import main

        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise AssertionError("unreachable")


def _report_exits(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exit": pid, "returncode": _returncode(status)})


def _returncode(status: int) -> int:
    """As ``subprocess.Popen.returncode``: the exit code, or minus the killing signal."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def main() -> None:
    fd, kind = int(sys.argv[1]), sys.argv[2]
    sock = socket.socket(fileno=fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher stops it by closing the socket
    # set up here, while the environment is whole: setproctitle takes over the memory after
    # argv, and its first call in a child (after the environment is replaced) changes nothing
    setproctitle.setproctitle(f"epdctl zygote ({kind} starts for pid {os.getppid()})")
    for name in PRELOAD[kind]:
        importlib.import_module(name)
    _send(sock, {"ready": True, "python_threads": threading.active_count()})
    serve(sock)


if __name__ == "__main__":
    main()
