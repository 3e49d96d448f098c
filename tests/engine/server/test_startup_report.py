"""``GET /health/ready`` says how the instance started: when each start-up phase ended, and
the batch budgets it searched against the SLO, which another instance of the same role and
flags can be given so it starts without searching (``epdctl up``'s pools do)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.processes import free_port, running

pytestmark = pytest.mark.slow

PHASES = ["main", "imports", "model_loaded", "budgets", "engine_built", "serving"]


def _ready(model: Path, log: Path, *extra: str) -> dict:
    port = free_port()
    args = [
        "serve", "--model", str(model), "--port", str(port), "--num-kv-blocks", "64",
        "--num-image-blocks", "8", "--max-model-len", "512", "--log-level", "warning", *extra,
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}/health/ready"
    with running(args, url, log):
        return httpx.get(url, timeout=5).json()


def test_ready_reports_phases_and_searched_budgets_that_a_second_instance_reuses(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    first = _ready(tiny_model_dir, tmp_path / "first.log")
    startup = first["startup"]
    assert list(startup) == PHASES  # in the order they ended (no router: no "registered")
    times = [startup[p] for p in PHASES]
    assert times == sorted(times)
    searched = first["searched_budgets"]
    assert set(searched) == {"token_budget", "image_token_budget"}
    assert all(v >= 1 for v in searched.values())

    second = _ready(
        tiny_model_dir,
        tmp_path / "second.log",
        "--token-budget", str(searched["token_budget"]),
        "--image-token-budget", str(searched["image_token_budget"]),
    )  # fmt: skip
    assert second["searched_budgets"] == {}  # given: nothing searched
    assert list(second["startup"]) == PHASES
