"""``epdctl up --emulate COST_MODEL``: the reconcile loop starts every instance as an emulated
one (``serve --emulate``) behind the real router, so a whole local deployment runs with no
torch, no weights and no checkpoint; its model name says it is emulated."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from epd_engine.local.state_file import read_state
from tests.processes import EPDCTL, free_port

REPO = Path(__file__).resolve().parents[2]
COST_MODEL = REPO / "benchmarks" / "results" / "cost-model-h200.json"


def epdctl(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*EPDCTL, *args], capture_output=True, text=True, timeout=timeout)


def manifest(tmp_path: Path, name: str, method: str, pools: dict[str, int]) -> Path:
    data: dict[str, Any] = {
        "apiVersion": "epd.serving.dev/v1alpha1",
        "kind": "EPDDeployment",
        "metadata": {"name": name},
        "spec": {
            # a preset no run makes: an emulated run neither makes nor reads a checkpoint
            "model": {"name": "llava-1.5-7b", "source": {"preset": "tiny-llava"}},
            "gpuBudget": sum(pools.values()),
            "disaggregation": {"mode": "Fixed", "method": method, "pools": pools},
        },
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_up_emulate_serves_the_openai_client_through_the_router(tmp_path: Path) -> None:
    runs, models = tmp_path / "runs", tmp_path / "models"
    file = manifest(tmp_path, "emu", "EPD", {"EPD": 1})
    common = ["--runs-dir", str(runs), "--models-dir", str(models)]
    up = epdctl("up", "-f", str(file), "--emulate", str(COST_MODEL), "--port", str(free_port()),
                "--detach", "--timeout", "60", *common)  # fmt: skip
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        state = read_state(runs / "emu")
        assert state is not None and state["ready"]
        url = state["router_url"]
        listed = httpx.get(f"{url}/v1/models").json()["data"]
        assert [m["id"] for m in listed] == ["llava-1.5-7b-emulated"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        answer = client.chat.completions.create(
            model="llava-1.5-7b-emulated",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=4,
        )
        assert answer.usage is not None and answer.usage.completion_tokens == 4
        (instance,) = state["instances"]
        ready = httpx.get(f"{instance['url']}/health/ready").json()
        assert ready["model"] == "llava-1.5-7b-emulated"
        assert ready["emulated"]["cost_model"] == str(COST_MODEL)
    finally:
        epdctl("down", "emu", "--runs-dir", str(runs))
    assert not models.exists()  # no checkpoint was made


@pytest.mark.parametrize(
    ("content", "why"),
    [(None, "cannot read cost model"), ("{}", "cost model")],
    ids=["missing", "invalid"],
)
def test_up_emulate_refuses_a_bad_cost_model_naming_it(
    tmp_path: Path, content: str | None, why: str
) -> None:
    bad = tmp_path / "cost.json"
    if content is not None:
        bad.write_text(content)
    runs = tmp_path / "runs"
    file = manifest(tmp_path, "emu", "EPD", {"EPD": 1})
    got = epdctl("up", "-f", str(file), "--emulate", str(bad), "--runs-dir", str(runs))
    assert got.returncode != 0
    assert f"--emulate {bad}:" in got.stderr and why in got.stderr
    assert "Traceback" not in got.stderr
    assert not runs.exists()  # nothing started
