"""Emulated instances behind the real router (real processes on loopback): they register and
heartbeat through the engine's ``RouterLink``, the router balances the ``openai`` client's
requests over them and relays their tokens, streamed or whole."""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import httpx
import openai

from tests.processes import free_port, running

REPO = Path(__file__).resolve().parents[3]
COST_MODEL = REPO / "benchmarks" / "results" / "cost-model-h200.json"
MODEL = "llava-1.5-7b-emulated"


def test_the_router_serves_the_client_from_emulated_instances(tmp_path: Path) -> None:
    env = {"EPD_INTERNAL_TOKEN": secrets.token_hex(16)}
    router_port = free_port()
    router_url = f"http://127.0.0.1:{router_port}"
    router_args = ["router", "--model", MODEL, "--port", str(router_port), "--log-level", "warning"]
    instance_ports = [free_port(), free_port()]

    def instance(port: int) -> list[str]:
        return ["serve", "--emulate", str(COST_MODEL), "--port", str(port),
                "--router-url", router_url, "--log-level", "warning"]  # fmt: skip

    with (
        running(router_args, f"{router_url}/health/live", tmp_path / "router.log", env),
        running(
            instance(instance_ports[0]),
            f"http://127.0.0.1:{instance_ports[0]}/health/ready",
            tmp_path / "a.log",
            env,
        ),
        running(
            instance(instance_ports[1]),
            f"http://127.0.0.1:{instance_ports[1]}/health/ready",
            tmp_path / "b.log",
            env,
        ),
    ):
        # the router turns ready once an instance registered (heartbeats every 0.5 s)
        deadline = time.monotonic() + 10
        while httpx.get(f"{router_url}/health/ready").status_code != 200:
            assert time.monotonic() < deadline, "no emulated instance registered"
            time.sleep(0.1)
        client = openai.OpenAI(base_url=f"{router_url}/v1", api_key="unused")
        answers = [
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=5
            )
            for i in range(6)
        ]
        for answer in answers:
            assert answer.usage is not None and answer.usage.completion_tokens == 5
            assert len((answer.choices[0].message.content or "").split()) == 5
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "stream"}], max_tokens=4, stream=True
        )
        assert len([c for c in stream if c.choices and c.choices[0].delta.content]) == 4
        served = [_requests_served(f"http://127.0.0.1:{port}/metrics") for port in instance_ports]
    assert sum(served) == 7
    assert all(n > 0 for n in served), served  # both instances got requests


def _requests_served(metrics_url: str) -> float:
    for line in httpx.get(metrics_url).text.splitlines():
        if line.startswith("epd_requests_total{") and 'outcome="success"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0
