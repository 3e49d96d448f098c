from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.processes import free_port, running


@pytest.fixture(scope="module")
def instance_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real ``epdctl serve`` process (role EPD) on 127.0.0.1 serving the tiny model."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    args = [
        "serve", "--model", str(tiny_model_dir), "--served-model-name", "tiny-llava",
        "--port", str(port), "--token-budget", "256", "--image-budget", "4",
        "--num-kv-blocks", "128", "--num-image-blocks", "8", "--max-num-running", "8",
        "--max-images-per-request", "3", "--max-image-bytes", "300000", "--max-model-len", "512",
        "--max-request-bytes", "2000000", "--max-image-pixels", "250000",
        "--max-request-pixels", "400000",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with running(args, f"{url}/health/ready", log):
        yield url
