"""``epdctl up --emulate COST_MODEL``: the reconcile loop starts every instance as an emulated
one (``serve --emulate``) behind the real router, so a whole local deployment runs with no
torch, no weights and no checkpoint; its model name says it is emulated."""

from __future__ import annotations

import json
import subprocess
import time
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


@pytest.mark.parametrize(
    "costs", [str(COST_MODEL), "reference:gemma3-4b"], ids=["file", "reference"]
)
def test_up_emulate_serves_the_openai_client_through_the_router(tmp_path: Path, costs: str) -> None:
    """A cost model file, or a built-in reference by name (no file to find)."""
    runs, models = tmp_path / "runs", tmp_path / "models"
    file = manifest(tmp_path, "emu", "EPD", {"EPD": 1})
    common = ["--runs-dir", str(runs), "--models-dir", str(models)]
    up = epdctl("up", "-f", str(file), "--emulate", costs, "--port", str(free_port()),
                "--detach", "--timeout", "60", *common)  # fmt: skip
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        state = read_state(runs / "emu")
        assert state is not None and state["ready"]
        url = state["router_url"]
        listed = httpx.get(f"{url}/v1/models").json()["data"]
        assert [m["id"] for m in listed] == ["llava-1.5-7b-emulated"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        answer = client.chat.completions.create(
            model="llava-1.5-7b-emulated",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=4,
        )
        assert answer.usage is not None and answer.usage.completion_tokens == 4
        (instance,) = state["instances"]
        ready = httpx.get(f"{instance['url']}/health/ready").json()
        assert ready["model"] == "llava-1.5-7b-emulated"
        assert ready["emulated"]["cost_model"] == costs
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


def test_up_emulate_runs_e_p_d_with_migrations_of_the_cost_models_bytes(tmp_path: Path) -> None:
    """Emulated E, P and D instances behind the router: an image request goes E -> P (image
    cache) -> D (KV), a text one P -> D; every pull "moves" the bytes the cost model's shape
    gives, and the router sees each migration."""
    runs = tmp_path / "runs"
    file = manifest(tmp_path, "epd3", "E+P+D", {"E": 1, "P": 1, "D": 1})
    up = epdctl("up", "-f", str(file), "--emulate", str(COST_MODEL), "--port", str(free_port()),
                "--detach", "--timeout", "60", "--runs-dir", str(runs))  # fmt: skip
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        state = read_state(runs / "epd3")
        assert state is not None and state["ready"]
        url, token = state["router_url"], state["token"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        image = {"type": "image_url", "image_url": {"url": "http://images.invalid/cat.png"}}
        asks = [
            [{"type": "text", "text": "what is this"}, image],
            [{"type": "text", "text": "hello there"}],
            [{"type": "text", "text": "one two three four five"}],
        ]
        prompt_tokens = 0
        for content in asks:
            answer = client.chat.completions.create(
                model="llava-1.5-7b-emulated",
                messages=[{"role": "user", "content": content}],  # type: ignore[list-item,misc]
                max_tokens=5,
            )
            assert answer.usage is not None and answer.usage.completion_tokens == 5
            assert len((answer.choices[0].message.content or "").split()) == 5
            prompt_tokens += answer.usage.prompt_tokens
        by_role = {i["role"]: i["url"] for i in state["instances"]}
        per_token = COSTS["migration"]
        image_bytes = COSTS["capacity"]["tokens_per_image"] * per_token["image_bytes_per_token"]
        assert pulled_bytes(by_role["P"]) == {"image": image_bytes}
        # D pulls each prompt's KV (the first output token's is computed at D)
        assert pulled_bytes(by_role["D"]) == {"kv": prompt_tokens * per_token["kv_bytes_per_token"]}
        assert pulled_bytes(by_role["E"]) == {}
        metrics = httpx.get(f"{url}/metrics", headers={"X-EPD-Token": token}).text
        assert sample(metrics, "epd_migration_seconds_count", 'kind="image"') == 1
        assert sample(metrics, "epd_migration_seconds_count", 'kind="kv"') == 3
        assert sample(metrics, "epd_requests_total", 'outcome="success"') == 3
        # each target's release reached its source: no page stays held for a pull
        deadline = time.monotonic() + 5
        while (held := held_pages(url, token)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert held == {}
    finally:
        epdctl("down", "epd3", "--runs-dir", str(runs))


COSTS = json.loads(COST_MODEL.read_text())


def pulled_bytes(instance_url: str) -> dict[str, float]:
    """``epd_emulated_migration_bytes_total`` of one instance, by kind."""
    out = {}
    for line in httpx.get(f"{instance_url}/metrics").text.splitlines():
        if line.startswith("epd_emulated_migration_bytes_total{"):
            kind = line.split('kind="', 1)[1].split('"', 1)[0]
            out[kind] = float(line.rsplit(" ", 1)[1])
    return out


def sample(metrics: str, name: str, label: str) -> float:
    """The sum of ``name``'s samples carrying ``label``."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith(name + "{") and label in line
    )


def held_pages(router_url: str, token: str) -> dict[str, tuple[int, int]]:
    """Instances holding pages of the KV or image cache (the router's table)."""
    capacity = COSTS["capacity"]
    pools = httpx.get(f"{router_url}/internal/pools", headers={"X-EPD-Token": token}).json()
    held = {}
    for pool in pools["pools"].values():
        for i in pool["instances"]:
            kv = capacity["num_kv_blocks"] - i["free_kv_blocks"] if i["role"] != "E" else 0
            image = capacity["num_image_blocks"] - i["free_image_blocks"] if i["role"] != "D" else 0
            if kv or image:
                held[i["role"]] = (kv, image)
    return held
