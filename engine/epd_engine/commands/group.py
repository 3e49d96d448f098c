"""``epdctl group``: run the engine instances of one placement group side by side.

A group is instances that exchange caches (the E, P and D of an E+P+D slice, or a P with its
D) in one pod on one node: one ``epdctl serve`` per member, every member seeing the pod's
GPUs, ``/dev/shm`` and IPC namespace, so ``auto`` moves their caches through shared memory
(``shm`` on CPU, ``cuda_ipc`` on GPUs) instead of the network. Each ``--member`` is one
member's ``epdctl serve`` arguments as one shell-quoted string (on GPUs, each member names
its own device, e.g. ``--device cuda:1``: not verified on a GPU yet).

The supervisor is what the pod runs: SIGTERM (or SIGINT) goes to every member, which drains
and exits; when any member exits on its own, the others are stopped and the group exits
with that member's status, so the kubelet restarts the pod as a whole (a member alone would
come back with a cache its partners no longer know).

Members register with the group's name (``EPD_GROUP``; default the host name, in a pod the
pod's, and the supervisor's pid), so their sources hand requests to peers of the same group
first (``contracts/group_locality.py``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from types import FrameType

from epd_engine.cli import UserError

POLL_S = 0.2


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "group", help="run several engine instances as one placement group (one pod)"
    )
    p.add_argument(
        "--member",
        action="append",
        required=True,
        help="one member's `epdctl serve` arguments, shell-quoted (repeat per member)",
    )
    p.add_argument(
        "--name",
        default=f"{socket.gethostname()}-{os.getpid()}",
        help="the group's name its members register with (default: host name and pid)",
    )
    p.add_argument(
        "--stop-timeout", type=float, default=60.0, help="seconds members get to drain (s)"
    )
    p.set_defaults(func=run)


def member_commands(members: list[str]) -> list[list[str]]:
    """Each member's command line: ``serve`` and its arguments."""
    out = []
    for text in members:
        args = shlex.split(text)
        if args[:1] == ["serve"]:
            args = args[1:]
        if not args:
            raise UserError("--member needs the member's `epdctl serve` arguments")
        out.append([sys.executable, "-m", "epd_engine", "serve", *args])
    return out


class Group:
    def __init__(self, commands: list[list[str]], stop_timeout_s: float, name: str = "") -> None:
        self.stop_timeout_s = stop_timeout_s
        self.stopping = False
        group = {"EPD_GROUP": name} if name else {}
        self.members = [
            subprocess.Popen(cmd, env={**os.environ, **group, "EPD_GROUP_MEMBER": str(i)})
            for i, cmd in enumerate(commands)
        ]

    def stop(self) -> None:
        """SIGTERM to every member still running, then SIGKILL after the timeout."""
        self.stopping = True
        for member in self.members:
            if member.poll() is None:
                member.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for member in self.members:
            try:
                member.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                member.kill()
                member.wait()

    def wait(self) -> int:
        """Until a member exits or the group is told to stop; the group's exit status."""
        while not self.stopping:
            for member in self.members:
                code = member.poll()
                if code is not None:
                    print(
                        f"epdctl group: member {self.members.index(member)} exited with {code};"
                        " stopping the others",
                        file=sys.stderr,
                        flush=True,
                    )
                    self.stop()
                    return code if code != 0 else 1  # a member is never meant to end alone
            time.sleep(POLL_S)
        return 0


def run(args: argparse.Namespace) -> int:
    group = Group(member_commands(args.member), args.stop_timeout, args.name)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        group.stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code = group.wait()
    if group.stopping:
        group.stop()
    return code
