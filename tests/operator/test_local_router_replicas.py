"""``epdctl up`` of a manifest with ``router.replicas: 2`` under the reconcile loop: two router
processes behind a per-connection balancer on the run's port; the instance registers with
both, the rollout is read back from both, and requests through the port all succeed,
owned by either replica."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from epd_engine.local.ports import free_port
from epd_engine.local.state_file import read_state
from tests.processes import EPDCTL

pytestmark = pytest.mark.slow

NUM_REQUESTS = 24

MANIFEST = {
    "apiVersion": "epd.serving.dev/v1alpha1",
    "kind": "EPDDeployment",
    "metadata": {"name": "pair"},
    "spec": {
        "model": {"name": "tiny-llava", "source": {"preset": "tiny-llava"}},
        "gpuBudget": 1,
        "disaggregation": {"mode": "Fixed", "method": "EPD", "pools": {"EPD": 1}},
        "router": {"replicas": 2},
        "engine": {
            "gpusPerInstance": 0,
            "numKvBlocks": 256,
            "numImageBlocks": 16,
            "extraArgs": ["--token-budget", "256", "--image-budget", "4"],
        },
    },
}


def successes(metrics_text: str) -> float:
    return sum(
        s.value
        for family in text_string_to_metric_families(metrics_text)
        for s in family.samples
        if s.name == "epd_requests_total" and s.labels.get("outcome") == "success"
    )


def epdctl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*EPDCTL, *args], capture_output=True, text=True, timeout=timeout)


async def ask_all(base_url: str) -> list[str | BaseException]:
    async def one(n: int) -> str:
        # a client each: a connection each, spread by the balancer
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
            kwargs = {"model": "tiny-llava", "max_tokens": 6, "temperature": 0}
            messages = [{"role": "user", "content": f"Count to {n}."}]
            if n % 2:
                stream = await client.chat.completions.create(
                    messages=messages, stream=True, **kwargs
                )  # type: ignore[call-overload]
                return "".join(
                    [c.choices[0].delta.content or "" async for c in stream if c.choices]
                )
            answer = await client.chat.completions.create(messages=messages, **kwargs)  # type: ignore[call-overload]
            return str(answer.choices[0].message.content)

    return await asyncio.gather(*(one(n) for n in range(NUM_REQUESTS)), return_exceptions=True)


def test_two_router_replicas_behind_one_port(tiny_model_dir: Path, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    file = tmp_path / "pair.yaml"
    file.write_text(yaml.safe_dump(MANIFEST))
    common = ["--runs-dir", str(runs)]
    up = epdctl(
        "up", "-f", str(file), "--model-dir", str(tiny_model_dir), "--port", str(free_port()),
        "--reconcile", "--detach", "--timeout", "300", *common, timeout=360,
    )  # fmt: skip
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        state = read_state(runs / "pair")
        assert state is not None and state["ready"]
        assert state["status"]["phase"] == "RolloutComplete"
        replicas = state["router_urls"]
        assert len(replicas) == 2 and state["router_url"] not in replicas

        answers = asyncio.run(ask_all(f"{state['router_url']}/v1"))
        assert [a for a in answers if isinstance(a, BaseException)] == []

        headers = {"X-EPD-Token": state["token"]}
        served = []
        for url in replicas:
            pools = httpx.get(f"{url}/internal/pools", headers=headers, timeout=5).json()
            assert [len(p["instances"]) for p in pools["pools"].values()] == [1]
            assert pools["active_pools"] is not None  # the rollout's switch reached it
            metrics = httpx.get(f"{url}/metrics", timeout=5).text
            served.append(successes(metrics))
        assert sum(served) == NUM_REQUESTS and min(served) > 0
    finally:
        epdctl("down", "pair", *common)
    assert read_state(runs / "pair") is None
