"""Engine processes forked from the zygote behave as freshly started ones do.

Launchers stop children with ``killpg`` and read ``returncode``; users and the soak read
``/proc/PID/cmdline``; the router and engines read their secret from the environment. A
forked child must give each of these what ``subprocess.Popen`` of ``python -m epd_engine``
gave, or `epdctl down`, restarts and process names break.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks.bench_emulate_start import COST_MODEL, rss_mib
from epd_engine.local.spawn import (
    Zygote,
    ZygoteChild,
    fork_stands_for_exec,
    spawn_epdctl,
)
from tests.processes import free_port, wait_ready


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    zygote = Zygote()
    yield zygote
    zygote.close()
    assert zygote.process.returncode == 0  # ended at EOF, and reaped (no zombie left)


def test_a_forked_router_is_what_a_started_one_is(zygote: Zygote, tmp_path: Path) -> None:
    port, token = free_port(), "s3cret"
    log = tmp_path / "router.log"
    env = {**zygote.env, "EPD_INTERNAL_TOKEN": token}  # differs in EPD_* alone
    args = ["router", "--model", "m", "--port", str(port), "--log-level", "warning"]
    with log.open("wb") as out:
        child = zygote.spawn(args, out.fileno(), env)
    assert isinstance(child, ZygoteChild)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(f"{url}/health/live", child, log, timeout_s=60)
        # the environment it was given: the secret opens the internal API, nothing else does
        pools = f"{url}/internal/pools"
        assert httpx.get(pools, headers={"X-EPD-Token": token}).status_code == 200
        assert httpx.get(pools, headers={"X-EPD-Token": "x"}).status_code in (401, 403)
        # its own session, as start_new_session gave (killpg stops it and only it)
        assert os.getsid(child.pid) == child.pid != os.getsid(0)
        # named as `python -m epd_engine router ...`
        cmdline = Path(f"/proc/{child.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert cmdline.split()[:4] == [sys.executable, "-m", "epd_engine", "router"]
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(0.2)
        assert child.poll() is None
        os.killpg(child.pid, signal.SIGINT)
        assert child.wait(30) == 0  # a clean shutdown on SIGINT, as a started router's
        assert "Traceback" not in log.read_text()
    finally:
        if child.poll() is None:
            child.kill()


def test_exit_codes_and_signals_reach_the_launcher(zygote: Zygote, tmp_path: Path) -> None:
    log = tmp_path / "out.log"
    with log.open("wb") as out:
        version = zygote.spawn(["--version"], out.fileno(), zygote.env)
        bad = zygote.spawn(["no-such-command"], out.fileno(), zygote.env)
        port = free_port()
        with_secret = {**zygote.env, "EPD_INTERNAL_TOKEN": "t"}  # else it exits at once
        router = ["router", "--model", "m", "--port", str(port)]
        killed = zygote.spawn(router, out.fileno(), with_secret)
    assert version is not None and bad is not None and killed is not None
    assert version.wait(30) == 0
    assert bad.wait(30) == 2  # argparse's usage error
    wait_ready(f"http://127.0.0.1:{port}/health/live", killed, log, timeout_s=60)  # serving
    killed.kill()
    assert killed.wait(30) == -signal.SIGKILL
    assert "epdctl 0." in log.read_text()


def test_only_epd_variables_may_differ() -> None:
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "2"}
    assert fork_stands_for_exec({**base, "EPD_INTERNAL_TOKEN": "t"}, base)
    # pytest's per-test marker: without it no test would fork (the defect this guards)
    assert fork_stands_for_exec({**base, "PYTEST_CURRENT_TEST": "t.py::a (call)"}, base)
    assert not fork_stands_for_exec({**base, "CUDA_VISIBLE_DEVICES": "1"}, base)
    assert not fork_stands_for_exec({**base, "OMP_NUM_THREADS": "1"}, base)
    assert not fork_stands_for_exec({"PATH": "/bin"}, base)  # one removed


def test_other_commands_start_afresh(tmp_path: Path) -> None:
    with (tmp_path / "out.log").open("wb") as out:
        plain = spawn_epdctl(["--version"], out, dict(os.environ))
    assert isinstance(plain, subprocess.Popen)
    assert plain.wait(60) == 0


def test_an_emulated_instance_forks_from_a_zygote_without_torch(tmp_path: Path) -> None:
    """Its own zygote: forked from the engine's, it would map torch and break its 100 MB."""
    port = free_port()
    args = ["serve", "--emulate", str(COST_MODEL), "--port", str(port), "--log-level", "warning"]
    log = tmp_path / "emulated.log"
    with log.open("wb") as out:
        child = spawn_epdctl(args, out, dict(os.environ))
    assert isinstance(child, ZygoteChild)
    try:
        wait_ready(f"http://127.0.0.1:{port}/health/ready", child, log, timeout_s=60)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert models["data"][0]["id"].endswith("-emulated")
        assert rss_mib(child.pid) < 100
        assert "torch" not in Path(f"/proc/{child.pid}/maps").read_text()
    finally:
        child.kill()
        child.wait(30)
