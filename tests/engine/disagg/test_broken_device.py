"""A broken device takes its instance out (issue 30, item 5), with real processes: a router
and three EPD instances of the tiny model on 127.0.0.1, under streaming traffic from the real
``openai`` client.

One instance's device "fails" with CUDA's sticky illegal-address error after a few steps,
another's engine thread hangs (``EPD_FAULT_INJECT``: a CPU cannot fail or hang as a GPU does,
so the worker raises the error CUDA raises, or blocks, at a chosen step). Each must leave
routing within 2 s of its probes failing (the router's heartbeat timeout is 30 s here, so
only the instance's own report can do it), answer 503 on ``/health/live`` (the kubelet
restarts it) and refuse direct clients; every stream completes through the healthy
instance with the tokens it gets there alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from epd_engine.config import internal_token
from tests.processes import free_port, running

pytestmark = pytest.mark.slow
STREAMS = 9
MAX_TOKENS = 24
OUT_WITHIN_S = 2.0
TOKEN = {"X-EPD-Token": internal_token()}
FAULTS = {
    "healthy": ({}, []),
    "device-error": ({"EPD_FAULT_INJECT": "device_error_after_steps:6"}, []),
    "hang": ({"EPD_FAULT_INJECT": "hang_after_steps:6"}, ["--stall-timeout-s", "2"]),
}


@dataclass
class System:
    router: str
    instances: dict[str, str]  # name -> url


@dataclass
class Outage:
    """When an instance's liveness first failed and when the router first left it out."""

    dead_s: float | None = None
    out_s: float | None = None
    reasons: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def system(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    logs = tmp_path_factory.mktemp("broken-device")
    router = f"http://127.0.0.1:{free_port()}"
    with ExitStack() as stack:
        stack.enter_context(
            running(
                ["router", "--model", "tiny-llava", "--port", router.rsplit(":", 1)[1],
                 "--instance-timeout", "30"],
                f"{router}/health/live",
                logs / "router.log",
            )
        )  # fmt: skip
        instances = {}
        for name, (env, extra) in FAULTS.items():
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            args = [
                "serve", "--model", str(tiny_model_dir), "--served-model-name", "tiny-llava",
                "--port", str(port), "--token-budget", "256", "--image-budget", "4",
                "--num-kv-blocks", "256", "--num-image-blocks", "16", "--max-num-running", "16",
                "--router-url", router, "--pool", "epd", "--instance-id", name, *extra,
            ]  # fmt: skip
            stack.enter_context(running(args, f"{url}/health/ready", logs / f"{name}.log", env))
            instances[name] = url
        deadline = time.monotonic() + 60
        while registered(router) != sorted(instances):
            assert time.monotonic() < deadline, f"registered: {registered(router)}"
            time.sleep(0.2)
        yield System(router, instances)


def registered(router: str) -> list[str]:
    pools = httpx.get(f"{router}/internal/pools", headers=TOKEN, timeout=5).json()["pools"]
    return sorted(i["instance_id"] for p in pools.values() for i in p["instances"])


def messages(index: int) -> list[dict[str, object]]:
    return [{"role": "user", "content": f"Tell me story number {index}."}]


async def stream_one(client: openai.AsyncOpenAI, index: int) -> str:
    stream = await client.chat.completions.create(  # type: ignore[call-overload]
        model="tiny-llava",
        messages=messages(index),
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    parts = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts)


async def watch(system: System, outages: dict[str, Outage], stop: asyncio.Event) -> None:
    """Poll each faulty instance's liveness and the router's table every 20 ms."""
    async with httpx.AsyncClient(timeout=2) as http:
        while not stop.is_set():
            pools = (await http.get(f"{system.router}/internal/pools", headers=TOKEN)).json()
            listed = {i["instance_id"] for p in pools["pools"].values() for i in p["instances"]}
            now = time.monotonic()
            for name, outage in outages.items():
                if outage.dead_s is None:
                    live = await http.get(f"{system.instances[name]}/health/live")
                    if live.status_code == 503:
                        outage.dead_s = now
                        outage.reasons.append(live.json()["reason"])
                if outage.out_s is None and name not in listed:
                    outage.out_s = now
            await asyncio.sleep(0.02)


async def test_broken_instances_leave_routing_and_every_stream_completes(system: System) -> None:
    outages = {name: Outage() for name in ("device-error", "hang")}
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch(system, outages, stop))
    client = openai.AsyncOpenAI(base_url=f"{system.router}/v1", api_key="-", max_retries=0)
    try:
        texts = await asyncio.wait_for(
            asyncio.gather(*(stream_one(client, i) for i in range(STREAMS))), 120
        )
        deadline = time.monotonic() + 10  # the hang is found 2 s after it starts
        while any(o.out_s is None or o.dead_s is None for o in outages.values()):
            assert time.monotonic() < deadline, outages
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        await watcher

    for name, outage in outages.items():
        assert outage.dead_s is not None and outage.out_s is not None, name
        print(f"{name}: out of routing {outage.out_s - outage.dead_s:+.2f} s after liveness failed")
        assert outage.out_s - outage.dead_s < OUT_WITHIN_S, (name, outage)
    assert "illegal memory access" in outages["device-error"].reasons[0]
    assert "no progress" in outages["hang"].reasons[0]
    assert registered(system.router) == ["healthy"]

    # every stream completed, with the tokens the healthy instance gives alone
    reference = await asyncio.gather(*(stream_one(client, i) for i in range(STREAMS)))
    assert texts == reference
    assert all(text for text in texts)

    async with httpx.AsyncClient(timeout=10) as http:
        for name in outages:
            url = system.instances[name]
            ready = await http.get(f"{url}/health/ready")
            direct = await http.post(
                f"{url}/v1/chat/completions",
                json={"model": "tiny-llava", "messages": messages(0), "max_tokens": 2},
            )
            assert ready.status_code == 503 and ready.json()["status"] == "out_of_service"
            assert direct.status_code == 503, direct.text
            assert "out of service" in direct.json()["error"]["message"]
