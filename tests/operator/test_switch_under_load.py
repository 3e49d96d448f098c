"""Switch under load: real router and real engine processes (tiny model, loopback), moved
through plans by the operator's rollout state machine while clients send steady traffic.

Nothing is faked: the pools are ``epdctl serve`` processes (``LocalPools``), the router is
``epdctl router``, the clients use the ``openai`` client; text and image prompts, streaming
and not, greedy. Zero failed, zero hung, and every answer equals the first plan's answer to
the same prompt before any switch.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.switch_drill import ENGINE_ARGS, MODEL_NAME, SEQUENCE, report, run_drill
from epd_engine.local.ports import free_port
from epd_operator.local.pools import LocalEngines
from tests.operator.test_router_api import _wait_live

pytestmark = pytest.mark.slow


@pytest.fixture
def engines(tiny_model_dir: Path, tmp_path: Path) -> Iterator[LocalEngines]:
    token = secrets.token_hex(8)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "epd_engine", "router", "--model", MODEL_NAME,
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, "EPD_INTERNAL_TOKEN": token},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        _wait_live(proc, url)
        yield LocalEngines(tiny_model_dir, MODEL_NAME, url, tmp_path, token, ENGINE_ARGS)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.parametrize(
    "plans",
    [
        pytest.param(SEQUENCE[:3], id="E+P+D>EP+D>EPD"),
        pytest.param(SEQUENCE[2:6], id="EPD>E+PD>ED+P>E+P+D"),
        pytest.param(SEQUENCE[5:], id="1E1P1D>1E2P1D"),
    ],
)
def test_switches_under_load_lose_nothing(engines: LocalEngines, plans: list) -> None:
    result = run_drill(engines, plans, budget=8, clients=2, settle_between_s=2.0)
    out = report(result)
    assert out["failed"] == 0, out["failures"]
    assert out["hung_clients"] == 0
    assert out["mismatched_outputs"] == 0
    assert out["requests"] > 0
    assert all(s["requests_spanning"] > 0 for s in out["switches"]), out["switches"]
    assert all(s["decision_to_serving_s"] is not None for s in out["switches"]), out["switches"]
