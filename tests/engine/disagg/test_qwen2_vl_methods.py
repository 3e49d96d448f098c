"""Qwen2-VL and Qwen2.5-VL through the router with real processes: every method gives the
tokens one EPD instance gives (greedy), with images of different sizes, so image embeddings
of varying token counts migrate E -> P and the M-RoPE positions stay right after each
migration."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from epd_engine.config import Method, internal_token
from epd_engine.contracts.trace import parse_trace
from tests.engine.disagg.systems import local_system, plan_for
from tests.engine.server.images import data_url
from tests.processes import free_port, running

pytestmark = pytest.mark.slow

# (name, image sizes): 4, 35 + 4 and 77 image tokens under both tiny presets' processors.
CASES: list[tuple[str, list[tuple[int, int]]]] = [
    ("text", []),
    ("small", [(64, 48)]),
    ("two-sizes", [(200, 150), (64, 48)]),
    ("large", [(300, 200)]),
]
TOKENS = {"text": [], "small": [4], "two-sizes": [35, 4], "large": [77]}


async def run_all(
    base_url: str, cases: list[tuple[str, list[tuple[int, int]]]] = CASES
) -> dict[str, str]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)

    async def one(index: int, sizes: list[tuple[int, int]]) -> str:
        parts: list[dict[str, object]] = [
            {"type": "image_url", "image_url": {"url": data_url(index * 10 + k, size)}}
            for k, size in enumerate(sizes)
        ]
        parts.append({"type": "text", "text": "Describe what you see."})
        response = await client.chat.completions.create(
            model="tiny-llava",  # the launcher's served name for test systems
            messages=[{"role": "user", "content": parts}],  # type: ignore[list-item,misc]
            max_tokens=10,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return str(response.choices[0].message.content)

    texts = await asyncio.gather(*(one(i, sizes) for i, (_, sizes) in enumerate(cases)))
    return {name: text for (name, _), text in zip(cases, texts, strict=True)}


FAMILIES = {"qwen2-vl": "tiny_qwen2_vl_dir", "qwen2.5-vl": "tiny_qwen2_5_vl_dir"}


@pytest.fixture(scope="module", params=list(FAMILIES))
def model_dir(request: pytest.FixtureRequest) -> Path:
    """The tiny checkpoint of one family (module scope: one reference per family)."""
    return Path(request.getfixturevalue(FAMILIES[request.param]))


@pytest.fixture(scope="module")
def qwen_reference(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    port = free_port()
    log = tmp_path_factory.mktemp("qwen-reference") / "serve.log"
    args = [
        "serve", "--model", str(model_dir), "--served-model-name", "tiny-llava",
        "--port", str(port), "--token-budget", "256", "--image-budget", "4",
        "--num-kv-blocks", "256", "--num-image-blocks", "16",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with running(args, f"{url}/health/ready", log):
        return asyncio.run(run_all(f"{url}/v1"))


@pytest.fixture(params=[m for m in Method if m is not Method.EPD], ids=lambda m: m.value)
def system_url(request: pytest.FixtureRequest, model_dir: Path, tmp_path: Path) -> Iterator[str]:
    plan = plan_for(request.param, {})
    with local_system(model_dir, tmp_path, plan) as system:
        yield system.spec.router_url


def test_methods_match_one_epd_instance(system_url: str, qwen_reference: dict[str, str]) -> None:
    assert all(qwen_reference.values())
    assert asyncio.run(run_all(f"{system_url}/v1")) == qwen_reference
    trace = httpx.get(f"{system_url}/v1/trace", headers={"X-EPD-Token": internal_token()})
    records = parse_trace(trace.text.splitlines())
    by_tokens = sorted([image.tokens for image in r.images] for r in records)
    assert by_tokens == sorted(TOKENS.values())
