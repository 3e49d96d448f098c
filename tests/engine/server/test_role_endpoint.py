"""An instance whose role cannot serve a request alone says so (issue 12): an E, P or D
instance's own /v1/chat/completions used to never answer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.engine.server.images import image_message
from tests.processes import free_port, running

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prefill_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("serve-p") / "serve.log"
    args = [
        "serve", "--model", str(tiny_model_dir), "--served-model-name", "tiny-llava",
        "--role", "P", "--port", str(port), "--token-budget", "256", "--image-budget", "4",
        "--num-kv-blocks", "64", "--max-model-len", "512",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with running(args, f"{url}/health/ready", log):
        yield url


@pytest.mark.parametrize(
    ("messages", "missing"),
    [
        ([{"role": "user", "content": "hi"}], "decode"),
        ([image_message("what is it?", 1)], "encode, decode"),
    ],
)
def test_role_instance_answers_its_own_endpoint_with_400(
    prefill_url: str, messages: list[dict[str, object]], missing: str
) -> None:
    body = {"model": "tiny-llava", "messages": messages, "max_tokens": 4}
    response = httpx.post(f"{prefill_url}/v1/chat/completions", json=body, timeout=10)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert f"cannot run {missing}" in error["message"]
    assert "router" in error["message"]
    assert error["code"] == "wrong_endpoint"
