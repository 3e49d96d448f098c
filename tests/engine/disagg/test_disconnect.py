"""Departed clients give their pages back (issue 12): 20 streams of 2,000 tokens closed
after 1 s ran on until the decode instance ran out of KV pages 16 s later, because the
router never told the engines. Real processes: router + one EPD instance."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epd_engine.bench.static_system import LocalSystem
from epd_engine.config import Method
from tests.engine.disagg.systems import local_system, plan_for

pytestmark = pytest.mark.slow
STREAMS = 20
KV_PAGES = 256  # ENGINE_ARGS of the test systems
HEARTBEAT_S = 0.5  # the router's view of free pages is at most this old


@pytest.fixture(scope="module")
def system(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSystem]:
    run_dir = tmp_path_factory.mktemp("disconnect")
    with local_system(tiny_model_dir, run_dir, plan_for(Method.EPD, {})) as s:
        yield s


def free_kv_pages(system: LocalSystem) -> int:
    pools = httpx.get(
        f"{system.spec.router_url}/internal/pools", headers=system.spec.headers()
    ).json()["pools"]
    return sum(i["free_kv_blocks"] for p in pools.values() for i in p["instances"])


def aborted_at_instance(system: LocalSystem) -> float:
    port = system.planned[0].port
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "epd_requests_total" and sample.labels.get("outcome") == "aborted"
    )


async def open_and_leave(system: LocalSystem) -> int:
    """Open the streams, let them run 1 s, leave; the free pages seen while they ran."""
    body = {
        "model": "tiny-llava",
        "messages": [{"role": "user", "content": "Tell me everything."}],
        "max_tokens": 2000,
        "stream": True,
        "ignore_eos": True,
    }
    async with httpx.AsyncClient(timeout=60) as http:

        async def one() -> None:
            url = f"{system.spec.router_url}/v1/chat/completions"
            async with http.stream("POST", url, json=body) as response:
                assert response.status_code == 200
                async for _ in response.aiter_lines():
                    pass

        streams = [asyncio.create_task(one()) for _ in range(STREAMS)]
        await asyncio.sleep(1.0 + HEARTBEAT_S)
        while_running = await asyncio.to_thread(free_kv_pages, system)
        for stream in streams:  # the clients go away mid-stream: connections closed
            stream.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    return while_running


def test_pages_come_back_within_a_second_of_the_clients_leaving(system: LocalSystem) -> None:
    while_running = asyncio.run(open_and_leave(system))
    left_s = time.monotonic()
    assert while_running < KV_PAGES
    while free_kv_pages(system) != KV_PAGES:
        assert time.monotonic() - left_s < 1.0 + HEARTBEAT_S, "pages still held"
        time.sleep(0.05)
    back_s = time.monotonic() - left_s
    print(f"{KV_PAGES - while_running} pages in use; all back {back_s:.2f} s after leaving")
    assert aborted_at_instance(system) == STREAMS
