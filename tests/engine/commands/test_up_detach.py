"""`epdctl up --detach` end to end (issue 12, items 5 and 7): the background supervisor
restarts a crashed instance, `epdctl down` stops everything it started, and an instance of
an earlier run cannot join a later run of the same name on the same port.

Real processes through the real CLI on the tiny model. Both runs hold the same secret (the
caller's ``EPD_INTERNAL_TOKEN``, as the test session sets it), which is how the stuck P of
the issue joined the next router: only the run's deployment id tells its processes apart.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.processes import EPDCTL, free_port

pytestmark = pytest.mark.slow

NAME = "detach"
MANIFEST = {
    "apiVersion": "epd.serving.dev/v1alpha1",
    "kind": "EPDDeployment",
    "metadata": {"name": NAME},
    "spec": {
        "model": {"name": "tiny-llava", "source": {"preset": "tiny-llava"}, "dtype": "float32"},
        "gpuBudget": 1,
        "disaggregation": {"mode": "Fixed", "method": "EPD", "pools": {"EPD": 1}},
        "engine": {
            "gpusPerInstance": 0,
            "numKvBlocks": 64,
            "numImageBlocks": 4,
            "extraArgs": ["--token-budget", "128", "--image-budget", "2"],
        },
    },
}


class Runs:
    """`epdctl up --detach` / `down` on one runs directory and router port."""

    def __init__(self, tmp_path: Path, model_dir: Path) -> None:
        self.manifest = tmp_path / "detach.yaml"
        self.manifest.write_text(yaml.safe_dump(MANIFEST))
        self.runs_dir = tmp_path / "runs"
        self.model_dir = model_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.seen_pids: set[int] = set()  # everything a run started, for the final cleanup

    def epdctl(self, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*EPDCTL, *args], capture_output=True, text=True, timeout=timeout_s, check=False
        )

    def up(self) -> dict[str, Any]:
        done = self.epdctl(
            "up", "-f", str(self.manifest), "--detach", "--port", str(self.port),
            "--model-dir", str(self.model_dir), "--runs-dir", str(self.runs_dir),
            "--timeout", "240",
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        assert "ready: OpenAI endpoint" in done.stdout
        return self.state()

    def down(self) -> None:
        done = self.epdctl("down", NAME, "--runs-dir", str(self.runs_dir), timeout_s=60)
        assert done.returncode == 0, done.stdout + done.stderr

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = json.loads((self.runs_dir / NAME / "state.json").read_text())
        self.seen_pids |= {state["pid"], *state["pids"]}
        return state

    def pools(self, token: str) -> dict[str, str]:
        """Instance id -> the URL the router has for it."""
        answer = httpx.get(f"{self.url}/internal/pools", headers={"X-EPD-Token": token}, timeout=5)
        answer.raise_for_status()
        return {
            i["instance_id"]: i["url"]
            for pool in answer.json()["pools"].values()
            for i in pool["instances"]
        }

    def chat(self) -> httpx.Response:
        body = {
            "model": "tiny-llava",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4,
            "temperature": 0,
        }
        return httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=60)


@pytest.fixture
def runs(tmp_path: Path, tiny_model_dir: Path) -> Iterator[Runs]:
    runs = Runs(tmp_path, tiny_model_dir)
    try:
        yield runs
    finally:
        if (runs.runs_dir / NAME / "state.json").exists():
            runs.epdctl("down", NAME, "--runs-dir", str(runs.runs_dir), timeout_s=60)
        for pid in runs.seen_pids:  # only what this test's runs started
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def wait_until(what: str, check: Callable[[], Any], timeout_s: float = 120) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, OSError, ValueError, KeyError):
            if result := check():
                return result
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except OSError:
        return False


def test_detached_run_is_supervised_stopped_and_not_joined_by_a_stale_instance(
    runs: Runs, tmp_path: Path
) -> None:
    # --- run 1: serves; its crashed instance comes back through the supervisor ------------
    first = runs.up()
    token = first["token"]
    assert alive(first["pid"]) and first["ready"]
    assert runs.chat().status_code == 200
    router_pid = first["pids"][0]  # the router first, then the engines
    [instance] = first["instances"]
    os.kill(instance["pid"], signal.SIGKILL)

    def restarted() -> dict[str, Any] | None:
        state = runs.state()
        [now] = state["instances"]
        if now["pid"] == instance["pid"] or now["name"] not in runs.pools(token):
            return None
        return state if runs.chat().status_code == 200 else None

    after_crash = wait_until("the supervisor to restart the instance", restarted, 180)
    assert after_crash["pid"] == first["pid"] and after_crash["pids"][0] == router_pid
    assert after_crash["instances"][0]["name"] == instance["name"]
    log = (runs.runs_dir / NAME / "logs" / "up.log").read_text()
    assert f"Restarted: engine {instance['name']} exited" in log

    # --- down: the supervisor, the router and every instance (the restarted one too) ------
    started = {first["pid"], *first["pids"], *after_crash["pids"]}
    runs.down()
    assert [pid for pid in started if alive(pid)] == []
    assert not (runs.runs_dir / NAME / "state.json").exists()
    with pytest.raises(httpx.ConnectError):
        runs.chat()

    # --- run 2 on the same port; an instance of run 1 (same token, same instance id) ------
    second = runs.up()
    assert second["deployment_id"] != first["deployment_id"]
    [ours] = second["instances"]
    url = wait_until("run 2's instance", lambda: runs.pools(token).get(ours["name"]))
    stale_log = tmp_path / "stale.log"
    with stale_log.open("wb") as out:
        stale = subprocess.Popen(
            [
                *EPDCTL, "serve", "--model", str(runs.model_dir), "--served-model-name",
                "tiny-llava", "--role", "EPD", "--pool", ours["pool"], "--instance-id",
                ours["name"], "--port", str(free_port()), "--router-url", runs.url,
                "--token-budget", "128", "--image-budget", "2", "--num-kv-blocks", "64",
                "--num-image-blocks", "4", "--log-level", "warning",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "EPD_DEPLOYMENT_ID": first["deployment_id"]},
            start_new_session=True,
        )  # fmt: skip
    try:
        # it tries to register (and is refused) several times: a heartbeat every 0.5 s
        wait_until(
            "the stale instance's refused heartbeats",
            lambda: stale_log.read_text().count("403") >= 3,
            180,
        )
        assert stale.poll() is None
        assert runs.pools(token) == {ours["name"]: url}  # its id never moved to the stale URL
        assert runs.chat().status_code == 200
    finally:
        stale.kill()
        stale.wait(10)
    runs.down()
    assert [pid for pid in {second["pid"], *second["pids"]} if alive(pid)] == []
