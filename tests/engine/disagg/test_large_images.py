"""Large images served, not refused (issue 31).

The released Qwen2-VL / Qwen2.5-VL processors resize to at most 12,845,056 pixels (16,384
image tokens), so a 4000x3000 phone photo is 15,301 image tokens. Every instance held 64
image-cache pages of 64 tokens (4,096) and, on a CPU, 512 KV pages of 16 (8,192 tokens):
the photo got a 400 (seen on the code before: "prompt needs 960 KV pages; this instance has
512"; past that, 240 image-cache pages against 64). Now each engine sizes its image cache
(and a CPU instance its KV pages) from the checkpoint's largest image, so every method
answers it, token for token as one EPD instance does. A deployment's
``--processor-max-pixels`` resizes it further instead, and a request beyond what fits
still gets a 400 naming the limit.

``tiny-qwen2-vl-12mp``: tiny shapes with the released processor bounds (random weights).
The caches are left to the engine (no ``--num-kv-blocks`` / ``--num-image-blocks``).
"""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from epd_engine.config import Method, internal_token
from epd_engine.contracts.image_grid import smart_resize
from epd_engine.contracts.plan import Budgets, Plan
from epd_engine.contracts.trace import parse_trace
from tests.engine.disagg.systems import local_system
from tests.processes import free_port, running

pytestmark = pytest.mark.slow

PHOTO_TOKENS = 107 * 143  # 4000x3000 -> 4004x2996 (multiples of 28, under 12.8 MP)
BUDGETS = Budgets(token_budget=2048, image_budget=4)
# the engine sizes its caches itself; only what keeps the CPU run small is given
BASE_ARGS = ["--max-num-running", "4", "--kv-layers-per-group", "1"]


def photo_url(width: int = 4000, height: int = 3000) -> str:
    """A smooth JPEG (a phone photo's size in well under a megabyte)."""
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x % 256, y % 256, (x + y) % 256], axis=-1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=80)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def photo_request(url: str, photos: int = 1) -> dict[str, object]:
    parts: list[dict[str, object]] = [{"type": "image_url", "image_url": {"url": url}}] * photos
    parts.append({"type": "text", "text": "Describe the photo."})
    return {
        "model": "tiny-llava",  # the launcher's served name for test systems
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }


def ask(base_url: str, url: str) -> tuple[str, int]:
    """The answer and its prompt tokens (the photo's image tokens and the text's)."""

    async def one() -> tuple[str, int]:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
        parts: list[dict[str, object]] = [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "Describe the photo."},
        ]
        response = await client.chat.completions.create(
            model="tiny-llava",  # the launcher's served name for test systems
            messages=[{"role": "user", "content": parts}],  # type: ignore[list-item,misc]
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert response.usage is not None
        return str(response.choices[0].message.content), response.usage.prompt_tokens

    return asyncio.run(one())


def image_tokens_traced(url: str) -> list[list[int]]:
    trace = httpx.get(f"{url}/v1/trace", headers={"X-EPD-Token": internal_token()})
    return [[image.tokens for image in r.images] for r in parse_trace(trace.text.splitlines())]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from epd_engine.model.make_model import make_model

    out = tmp_path_factory.mktemp("tiny-qwen2-vl-12mp")
    return make_model("tiny-qwen2-vl-12mp", out, seed=0, show_progress=False)


@pytest.fixture(scope="module")
def photo() -> str:
    return photo_url()


def serve_args(model_dir: Path, port: int, *extra: str) -> list[str]:
    return [
        "serve", "--model", str(model_dir), "--served-model-name", "tiny-llava",
        "--port", str(port), "--token-budget", str(BUDGETS.token_budget),
        "--image-budget", str(BUDGETS.image_budget), *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def reference(
    model_dir: Path, photo: str, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, int]:
    """One EPD instance's answer; it also refuses two photos (more than its cache holds)."""
    port = free_port()
    log = tmp_path_factory.mktemp("large-image-reference") / "serve.log"
    url = f"http://127.0.0.1:{port}"
    with running(serve_args(model_dir, port), f"{url}/health/ready", log):
        answer = ask(f"{url}/v1", photo)
        two = httpx.post(f"{url}/v1/chat/completions", json=photo_request(photo, 2), timeout=300)
    assert two.status_code == 400, two.text
    # the limit is named: 2 x 240 pages against a cache sized for one largest image (256)
    assert "2 images need 480 image-cache pages; this instance has 256" in two.text
    return answer


@pytest.fixture(params=list(Method), ids=lambda m: m.value)
def system_url(request: pytest.FixtureRequest, model_dir: Path, tmp_path: Path) -> Iterator[str]:
    method: Method = request.param
    plan = Plan(
        method=method,
        pools=dict.fromkeys(method.roles, 1),
        budgets=dict.fromkeys(method.roles, BUDGETS),
    )
    # a single EPD instance reports nothing between the photo's arrival and its first token
    # (encode, then 8 prefill chunks): more than the 60 s default on a loaded CPU
    with local_system(
        model_dir, tmp_path, plan, base_args=BASE_ARGS, progress_timeout_s=300
    ) as system:
        yield system.spec.router_url


def test_a_12mp_photo_is_served_on_every_method(
    system_url: str, photo: str, reference: tuple[str, int]
) -> None:
    assert reference[0] and reference[1] > PHOTO_TOKENS
    assert ask(f"{system_url}/v1", photo) == reference
    assert image_tokens_traced(system_url) == [[PHOTO_TOKENS]]


def test_a_deployment_lower_max_pixels_resizes_the_photo(
    model_dir: Path, photo: str, reference: tuple[str, int], tmp_path: Path
) -> None:
    """--processor-max-pixels 1003520 (1280 tokens): the photo is resized further, the
    processor, the token rule and M-RoPE agree (the engine checks the processor's count)."""
    height, width = smart_resize(3000, 4000, 28, 56 * 56, 1003520)
    expected = height * width // (28 * 28)
    assert expected < 1280 < PHOTO_TOKENS
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = serve_args(model_dir, port, "--processor-max-pixels", "1003520")
    with running(args, f"{url}/health/ready", tmp_path / "serve.log"):
        text, prompt_tokens = ask(f"{url}/v1", photo)
    assert text
    assert prompt_tokens - reference[1] == expected - PHOTO_TOKENS  # the same text around it
