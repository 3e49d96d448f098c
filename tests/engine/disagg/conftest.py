"""Fixtures shared by the disaggregated-system tests."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.engine.disagg.workload import run_all
from tests.processes import free_port, running


@pytest.fixture(scope="session")
def reference(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Outputs of one standalone EPD instance (no router): what every method must give."""
    port = free_port()
    log = tmp_path_factory.mktemp("reference") / "serve.log"
    args = [
        "serve", "--model", str(tiny_model_dir), "--served-model-name", "tiny-llava",
        "--port", str(port), "--token-budget", "256", "--image-budget", "4",
        "--num-kv-blocks", "256", "--num-image-blocks", "16",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with running(args, f"{url}/health/ready", log):
        return asyncio.run(run_all(f"{url}/v1"))
