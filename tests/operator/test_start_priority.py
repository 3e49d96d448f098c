"""Engines a local rollout starts run at +10 nice until a pass sees them Ready, then every
thread of theirs goes back to the normal priority (``start_priority``).

The processes are real; a sleeping Python child stands in for the engine (what is tested is
the priority of its threads, not serving), and the router's list is replaced.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from epd_engine.config import Role
from epd_operator.kube.manifests import PoolSpec
from epd_operator.local import pools as local_pools
from epd_operator.local import start_priority
from epd_operator.local.pools import LocalEngines, LocalPools

# threads made after the parent lowered it: they inherit the main thread's nice value
CHILD = (
    "import threading, time; time.sleep(0.5); "
    "[threading.Thread(target=time.sleep, args=(60,), daemon=True).start() for _ in range(3)]; "
    "time.sleep(60)"
)

needs_a_way_back = pytest.mark.skipif(
    not start_priority.may_restore(), reason="this user may not lower a nice value again"
)


def thread_nice(pid: int) -> list[int]:
    """Each thread's nice value (field 19 of /proc/PID/task/TID/stat)."""
    values = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        values.append(int(stat.rsplit(")", 1)[1].split()[16]))
    return values


def wait_for_threads(pid: int, count: int) -> None:
    deadline = time.monotonic() + 30
    while len(os.listdir(f"/proc/{pid}/task")) < count:
        assert time.monotonic() < deadline, "the child did not start its threads"
        time.sleep(0.05)


@pytest.fixture
def child() -> Any:
    process = subprocess.Popen([sys.executable, "-c", CHILD])
    yield process
    process.kill()
    process.wait()


@needs_a_way_back
def test_lowered_at_start_and_every_thread_restored(child: subprocess.Popen[bytes]) -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert start_priority.lower(child.pid)
    wait_for_threads(child.pid, 4)
    assert thread_nice(child.pid) == [base + start_priority.STARTING_NICE] * 4
    start_priority.restore(child.pid)
    assert thread_nice(child.pid) == [base] * 4


def test_no_lowering_without_a_way_back(
    child: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(start_priority, "may_restore", lambda: False)
    assert not start_priority.lower(child.pid)
    assert thread_nice(child.pid) == [os.getpriority(os.PRIO_PROCESS, 0)]


class _Registered:
    def __init__(self, ids: list[str]) -> None:
        self.ids = ids

    def raise_for_status(self) -> None:
        pass

    def json(self) -> dict[str, Any]:
        instances = [{"instance_id": i} for i in self.ids]
        return {"status": "ready", "pools": {"all": {"instances": instances}}}


@needs_a_way_back
def test_local_pools_restore_a_replica_when_a_pass_sees_it_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[subprocess.Popen[bytes]] = []
    real_popen = subprocess.Popen

    def spawn(args: list[str], *_: Any) -> subprocess.Popen[bytes]:
        process = real_popen([sys.executable, "-c", CHILD])  # stands in for the engine
        started.append(process)
        return process

    registered: list[str] = []
    monkeypatch.setattr(local_pools, "spawn_epdctl", spawn)
    monkeypatch.setattr(local_pools.httpx, "get", lambda url, **_: _Registered(registered))
    engines = LocalEngines(tmp_path / "model", "tiny", "http://127.0.0.1:1", tmp_path, "token")
    pools = LocalPools(engines)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        pools.apply_pool(PoolSpec("p-1", Role.P, 1, 0))
        pid = started[0].pid
        wait_for_threads(pid, 4)
        assert pools.observe_pools()["p-1"].ready == 0
        assert thread_nice(pid) == [base + start_priority.STARTING_NICE] * 4  # still starting
        registered.append("p-1-0")
        assert pools.observe_pools()["p-1"].ready == 1
        assert thread_nice(pid) == [base] * 4
    finally:
        for process in started:
            process.kill()
            process.wait()
