"""Gemma 3 through the router with real processes: every method gives the text one EPD
instance gives (greedy). Its prompts are longer than tiny-gemma3's 16-token window, so a
KV hand-off leaves the pages behind the window out for the sliding layers
(``transfer/plan.py``); the tokens stay the same only if no page a layer still reads was
left out."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from epd_engine.config import Method
from tests.engine.disagg.systems import local_system, plan_for
from tests.engine.disagg.test_qwen2_vl_methods import run_all
from tests.processes import free_port, running

pytestmark = pytest.mark.slow

CASES: list[tuple[str, list[tuple[int, int]]]] = [
    ("text", []),
    ("one", [(64, 48)]),
    ("two", [(200, 150), (64, 48)]),
]


@pytest.fixture(scope="module")
def reference(tiny_gemma3_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    port = free_port()
    log = tmp_path_factory.mktemp("gemma3-reference") / "serve.log"
    args = [
        "serve", "--model", str(tiny_gemma3_dir), "--served-model-name", "tiny-llava",
        "--port", str(port), "--token-budget", "256", "--image-budget", "4",
        "--num-kv-blocks", "256", "--num-image-blocks", "16",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with running(args, f"{url}/health/ready", log):
        return asyncio.run(run_all(f"{url}/v1", CASES))


@pytest.fixture(params=[m for m in Method if m is not Method.EPD], ids=lambda m: m.value)
def router_url(
    request: pytest.FixtureRequest, tiny_gemma3_dir: Path, tmp_path: Path
) -> Iterator[str]:
    with local_system(tiny_gemma3_dir, tmp_path, plan_for(request.param, {})) as s:
        yield s.spec.router_url


def test_methods_match_one_epd_instance(router_url: str, reference: dict[str, str]) -> None:
    assert all(reference.values())
    assert asyncio.run(run_all(f"{router_url}/v1", CASES)) == reference


@pytest.mark.parametrize("backend", ["tcp", "collective"])
def test_e_p_d_over_the_other_backends_matches_one_epd_instance(
    backend: str, tiny_gemma3_dir: Path, tmp_path: Path, reference: dict[str, str]
) -> None:
    """The windowed KV pull (``transfer/plan.py``) through the byte-stream backends too, not
    only shared memory (``auto`` on one host): a page layout or an offset that only shm got
    right would change the tokens here."""
    plan = plan_for(Method.E_P_D, {})
    with local_system(tiny_gemma3_dir, tmp_path, plan, transfer_backend=backend) as s:
        assert asyncio.run(run_all(f"{s.spec.router_url}/v1", CASES)) == reference
