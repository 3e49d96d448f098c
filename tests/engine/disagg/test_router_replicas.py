"""Two router replicas behind a per-connection balancer (what a Service does), real
processes: every request succeeds with the tokens one instance gives, whichever replica
a client reached, and every replica knows every instance.

Before the owner was named in request ids, instances registered through the balancer (so
with one replica each) and sent all events there: of 40 requests most got 503 or hung."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epd_engine.bench.static_system import LaunchSpec, LocalSystem
from epd_engine.config import Method
from epd_engine.local.ports import free_port
from tests.engine.disagg.systems import ENGINE_ARGS, plan_for
from tests.engine.disagg.workload import CASES, run_case

pytestmark = pytest.mark.slow

ROUNDS = 7  # x 6 cases: 42 requests, half of them streaming


@pytest.fixture
def replicated(tiny_model_dir: Path, tmp_path: Path) -> Iterator[LocalSystem]:
    spec = LaunchSpec(
        name="test",
        model_name="tiny-llava",
        model_dir=tiny_model_dir,
        plan=plan_for(Method.EP_D, {}),  # every request migrates: two instances send events
        router_port=free_port(),
        run_dir=tmp_path,
        engine_args=list(ENGINE_ARGS),
        router_replicas=2,
    )
    system = LocalSystem(spec)
    system.start()
    try:
        system.wait_ready(timeout_s=240)
        yield system
    finally:
        system.stop()


async def run_rounds(base_url: str) -> list[tuple[str, str | BaseException]]:
    # one client per request: a fresh connection each, so the balancer spreads them
    async def one(case_index: int) -> str:
        async with openai.AsyncOpenAI(
            base_url=base_url, api_key="unused", max_retries=0, timeout=120
        ) as client:
            return await run_case(client, CASES[case_index])

    work = [i for _ in range(ROUNDS) for i in range(len(CASES))]
    results = await asyncio.gather(*(one(i) for i in work), return_exceptions=True)
    return [(CASES[i].name, r) for i, r in zip(work, results, strict=True)]


def requests_served(router_url: str) -> float:
    text = httpx.get(f"{router_url}/metrics", timeout=5).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "epd_requests_total" and s.labels.get("outcome") == "success"
    )


def test_every_request_succeeds_through_either_replica(
    replicated: LocalSystem, reference: dict[str, str]
) -> None:
    spec = replicated.spec
    results = asyncio.run(run_rounds(f"{spec.router_url}/v1"))

    failed = [(name, repr(r)) for name, r in results if isinstance(r, BaseException)]
    assert failed == []
    assert [(name, text) for name, text in results if text != reference[name]] == []
    # both replicas owned requests, and each knows both instances
    served = [requests_served(url) for url in spec.router_urls]
    assert sum(served) == len(results) and min(served) > 0
    for url in spec.router_urls:
        pools = httpx.get(f"{url}/internal/pools", headers=spec.headers(), timeout=5).json()
        names = sorted(i["instance_id"] for p in pools["pools"].values() for i in p["instances"])
        assert names == ["test-d-0", "test-ep-0"]
