"""Qwen3-VL through the router with real processes: every method gives the tokens one EPD
instance gives (greedy). Its image pages carry the DeepStack levels beside each embedding
(rows of 4 x hidden), so the E -> P hand-off is exact only if every backend moves them
whole: E+P+D runs on tcp and collective as well as on shared memory (``auto``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epd_engine.config import Method, internal_token
from epd_engine.contracts.trace import parse_trace
from tests.engine.disagg.systems import local_system, plan_for
from tests.engine.disagg.test_qwen2_vl_methods import run_all
from tests.processes import free_port, running

pytestmark = pytest.mark.slow

# 4, 30 + 4 and 108 image tokens (two 64-token image pages) under tiny-qwen3-vl's processor
CASES: list[tuple[str, list[tuple[int, int]]]] = [
    ("text", []),
    ("small", [(64, 48)]),
    ("two-sizes", [(200, 150), (64, 48)]),
    ("multi-page", [(400, 300)]),
]
TOKENS = [[], [4], [30, 4], [108]]


@pytest.fixture(scope="module")
def reference(tiny_qwen3_vl_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    port = free_port()
    log = tmp_path_factory.mktemp("qwen3-reference") / "serve.log"
    args = [
        "serve", "--model", str(tiny_qwen3_vl_dir), "--served-model-name", "tiny-llava",
        "--port", str(port), "--token-budget", "256", "--image-budget", "4",
        "--num-kv-blocks", "256", "--num-image-blocks", "16",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with running(args, f"{url}/health/ready", log):
        return asyncio.run(run_all(f"{url}/v1", CASES))


def matrix() -> list[tuple[Method, str]]:
    methods: list[Method] = [m for m in Method if m is not Method.EPD]
    return [(m, "auto") for m in methods] + [(Method.E_P_D, b) for b in ("tcp", "collective")]


@pytest.fixture(params=matrix(), ids=lambda p: f"{p[0].value}-{p[1]}")
def system(
    request: pytest.FixtureRequest, tiny_qwen3_vl_dir: Path, tmp_path: Path
) -> Iterator[tuple[Method, str]]:
    method, backend = request.param
    plan = plan_for(method, {})
    with local_system(tiny_qwen3_vl_dir, tmp_path, plan, transfer_backend=backend) as s:
        yield method, s.spec.router_url


def test_methods_match_one_epd_instance(
    system: tuple[Method, str], reference: dict[str, str]
) -> None:
    method, url = system
    assert all(reference.values())
    assert asyncio.run(run_all(f"{url}/v1", CASES)) == reference
    trace = httpx.get(f"{url}/v1/trace", headers={"X-EPD-Token": internal_token()})
    records = parse_trace(trace.text.splitlines())
    assert sorted([image.tokens for image in r.images] for r in records) == sorted(TOKENS)
    # every image request handed its pages (DeepStack levels in them) to another instance,
    # except where one instance both encodes and prefills
    assert image_migrations(url) == (0 if method is Method.EP_D else 3)


def image_migrations(router_url: str) -> int:
    """Requests whose image pages were handed off (the router's
    epd_migration_seconds{kind="image"})."""
    return int(
        sum(
            sample.value
            for family in text_string_to_metric_families(httpx.get(f"{router_url}/metrics").text)
            for sample in family.samples
            if sample.name == "epd_migration_seconds_count" and sample.labels["kind"] == "image"
        )
    )
