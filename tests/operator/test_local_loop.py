"""Local mode runs the operator's reconcile loop: ``epdctl up`` of a ``mode: Auto`` manifest
plans by itself, and ``epdctl apply -f`` changes the running deployment, which converges
through the rollout state machine (new pools, switch read back, drain, old pools stopped)
while clients keep sending requests: none fails.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from benchmarks.switch_drill import Traffic
from epd_engine.local.state_file import read_state
from epd_operator.local.run import MANIFEST, manifest_generation, write_manifest
from tests.processes import EPDCTL, free_port


def manifest(name: str, budget: int, disaggregation: dict) -> dict:
    return {
        "apiVersion": "epd.serving.dev/v1alpha1",
        "kind": "EPDDeployment",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": "tiny-llava", "source": {"preset": "tiny-llava"}},
            "gpuBudget": budget,
            "disaggregation": disaggregation,
            "engine": {
                "gpusPerInstance": 0,
                "numKvBlocks": 256,
                "numImageBlocks": 16,
                "extraArgs": ["--token-budget", "256", "--image-budget", "4"],
            },
        },
    }


def epdctl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*EPDCTL, *args], capture_output=True, text=True, timeout=timeout)


def write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def test_manifest_generations_count_up(tmp_path: Path) -> None:
    path = tmp_path / MANIFEST
    assert manifest_generation(path) == 0
    assert write_manifest(path, "a: 1\n") == 1
    assert write_manifest(path, "a: 2\n") == 2
    assert yaml.safe_load(path.read_text()) == {"a": 2}
    assert path.stat().st_mode & 0o077 == 0  # private, like the state file


def test_apply_needs_a_running_reconciled_deployment(tmp_path: Path) -> None:
    fixed = {"mode": "Fixed", "method": "EPD", "pools": {"EPD": 1}}
    file = write(tmp_path / "m.yaml", manifest("solo", 1, fixed))
    runs = tmp_path / "runs"
    got = epdctl("apply", "-f", str(file), "--runs-dir", str(runs))
    assert got.returncode != 0
    assert "no running deployment 'solo'" in got.stderr
    # a static system (a benchmark's LocalSystem: no reconcile loop) cannot change
    (runs / "solo").mkdir(parents=True)
    (runs / "solo" / "state.json").write_text(json.dumps({"name": "solo", "pid": 1}))
    got = epdctl("apply", "-f", str(file), "--runs-dir", str(runs))
    assert got.returncode != 0
    assert "restart it with `epdctl up`" in got.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: EPDDeployment\nspec: {gpuBudget: -1}\n")
    got = epdctl("apply", "-f", str(bad), "--runs-dir", str(runs))
    assert got.returncode != 0 and got.stderr.strip()


@pytest.mark.slow
def test_auto_up_then_apply_converges_under_traffic(tiny_model_dir: Path, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    auto = write(tmp_path / "auto.yaml", manifest("loop", 3, {"mode": "Auto"}))
    port = free_port()
    common = ["--runs-dir", str(runs)]
    up = epdctl(
        "up", "-f", str(auto), "--model-dir", str(tiny_model_dir), "--port", str(port),
        "--detach", "--timeout", "400", *common, timeout=460,
    )  # fmt: skip
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        state = read_state(runs / "loop")
        assert state is not None and state["reconcile"] and state["ready"]
        first = state["status"]
        # no trace yet: the heuristic's split of 3 instances
        assert first["plan"] == "E+P+D 1E1P1D" and "heuristic" in first["reason"]
        assert first["phase"] == "RolloutComplete"
        old_d = next(n for n, p in first["pools"].items() if p["role"] == "D")

        fixed = {"mode": "Fixed", "method": "EP+D", "pools": {"EP": 1, "D": 1}}
        change = write(tmp_path / "ep-d.yaml", manifest("loop", 3, fixed))
        with Traffic(state["router_url"], clients=2) as traffic:
            applied = epdctl("apply", "-f", str(change), "--wait", "--timeout", "400", *common,
                             timeout=460)  # fmt: skip
        assert applied.returncode == 0, applied.stdout + applied.stderr
        phases = applied.stdout
        assert "WaitingForPools" in phases and "RolloutComplete" in phases
        failures = [a.error for a in traffic.answers if a.error]
        assert failures == [] and traffic.hung == 0
        assert len(traffic.answers) > 0
        state = read_state(runs / "loop")
        assert state is not None and state["observed_generation"] == 2
        now = state["status"]
        assert now["plan"] == "EP+D 1EP1D" and now["revision"] == 2
        assert sorted(p["role"] for p in now["pools"].values()) == ["D", "EP"]
        assert old_d in now["pools"], "an unchanged pool is kept, not restarted"
        assert sorted(now["active_pools"]) == sorted(now["pools"])

        # a manifest of another deployment is refused by the running loop, which keeps going
        text = yaml.safe_dump(manifest("other", 3, fixed))
        write_manifest(runs / "loop" / MANIFEST, text)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            state = read_state(runs / "loop")
            if state and state["spec_error"]:
                break
            time.sleep(0.5)
        assert state is not None and "metadata.name is 'other'" in state["spec_error"]
        assert state["observed_generation"] == 2 and state["status"]["plan"] == "EP+D 1EP1D"
        status = epdctl("status", "loop", *common)
        assert status.returncode == 0 and "EP" in status.stdout
    finally:
        epdctl("down", "loop", *common)
    assert read_state(runs / "loop") is None
