"""`epdctl up` replaces crashed children and `epdctl down` leaves nothing behind (issue 12).

Real child processes: an `epdctl router` started without its secret (it exits at once, a
crash loop) and a child that ignores SIGINT and SIGTERM (a stuck instance).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from epd_engine.bench.static_system import LaunchSpec, LocalSystem, Process
from epd_engine.commands.up import _stop_run
from epd_engine.config import Method
from epd_engine.contracts.plan import Plan


def system(tmp_path: Path) -> LocalSystem:
    plan = Plan(method=Method.EPD, pools={"EPD": 1})
    return LocalSystem(LaunchSpec("t", "m", tmp_path, plan, 1, tmp_path / "run"))


def test_a_crashed_child_is_restarted_with_growing_back_off(tmp_path: Path) -> None:
    """A crashed instance was never replaced (`up` printed a warning; --detach had none)."""
    local = system(tmp_path)
    crashing = Process(
        "router",
        ["router", "--model", "m", "--port", "1"],
        {"EPD_INTERNAL_TOKEN": ""},  # refuses to start: exits with an error each time
        tmp_path / "router.log",
    )
    local.processes.append(crashing)
    news: list[str] = []
    deadline = time.monotonic() + 60
    while crashing.restarts < 3 and time.monotonic() < deadline:
        news += local.supervise()
        time.sleep(0.05)
    local.stopping = True
    crashing.popen.wait(30)

    waits = [line.split("restarting in ")[1].split(" s")[0] for line in news if "in " in line]
    assert waits[:3] == ["0.5", "1.0", "2.0"], news
    assert crashing.restarts == 3
    assert "EPD_INTERNAL_TOKEN" in crashing.log.read_text()  # each run's log is kept


def test_down_kills_a_child_that_ignores_sigint(tmp_path: Path) -> None:
    """`epdctl down` left a stuck P running, which then joined the next run's router."""
    stuck = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)",
            "epd_engine",  # how `down` knows the pid is still one of ours
        ],
        start_new_session=True,
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    state = {"name": "t", "pid": None, "pids": [stuck.pid], "router_url": "http://x"}
    (run_dir / "state.json").write_text(json.dumps(state))
    time.sleep(0.5)  # the child has set its signal handlers

    _stop_run(run_dir)

    assert stuck.wait(10) == -9
    assert not (run_dir / "state.json").exists()


class Script(Process):
    """A supervised child running a Python snippet instead of an `epdctl` command."""

    def __init__(self, script: str, log: Path) -> None:
        self.script = script
        super().__init__("stuck", [], {}, log)

    def _spawn(self) -> subprocess.Popen[bytes]:
        self.started_s = time.monotonic()
        return subprocess.Popen([sys.executable, "-c", self.script], start_new_session=True)


def test_stop_kills_a_stuck_child_and_what_it_started(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    local = system(tmp_path)
    stuck = Script(
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(600)\n",
        tmp_path / "stuck.log",
    )
    local.processes.append(stuck)
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    grandchild = int(pid_file.read_text())

    local.stop(timeout_s=1)

    assert stuck.popen.returncode == -9
    deadline = time.monotonic() + 10
    while _alive(grandchild):
        assert time.monotonic() < deadline, "the instance's own child outlived the run"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"  # a zombie is gone, waiting for init
    except OSError:
        return False
