"""Kill or freeze each role mid-load (issue 12): 16 concurrent streams through E+P+D on
1-instance and 2-instance pools, real processes under the launcher's supervisor.

Every stream must end: complete and identical to the fault-free reference, or with a clear
error. None may hang (a stream once got 200 and a role chunk, then nothing for 60 s). After
each fault the supervisor (kill) or the process itself (freeze, then SIGCONT) restores the
service before the next one. The counts of each run are printed (``-s``) and, with
``EPD_FAULT_REPORT=path``, appended there as JSON lines.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from epd_engine.bench.static_system import LocalSystem
from epd_engine.config import Method
from tests.engine.disagg.systems import local_system, plan_for
from tests.engine.server.images import image_message

pytestmark = pytest.mark.slow
STREAMS = 16
MAX_TOKENS = 24
HUNG_S = 90.0  # a stream not over by then is hung (the router's watchdog is at 20 s)


@pytest.fixture(scope="module", params=[1, 2], ids=["1-instance", "2-instance"])
def system(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalSystem]:
    n = request.param
    plan = plan_for(Method.E_P_D, {"E": n, "P": n, "D": n})
    run_dir = tmp_path_factory.mktemp(f"faults-{n}")
    with local_system(
        tiny_model_dir,
        run_dir,
        plan,
        # the defaults' heartbeat timeout: on a loaded 2-core machine a busy, healthy
        # instance's heartbeats can lapse for more than 1.5 s
        instance_timeout_s=3.0,
        # above the 10 s a source waits for a frozen target to take its offer
        progress_timeout_s=20.0,
        supervised=True,
    ) as s:
        yield s


def messages(index: int) -> list[dict[str, object]]:
    if index % 2:
        return [image_message(f"Describe picture {index}.", index % 4)]
    return [{"role": "user", "content": f"Tell me story number {index}."}]


async def stream_one(client: openai.AsyncOpenAI, index: int, started: asyncio.Event) -> str:
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
            started.set()
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts)


async def load(url: str, fault=None) -> list[tuple[str, str]]:  # type: ignore[no-untyped-def]
    """Run the streams (injecting ``fault`` once tokens flow); (outcome, text or error)."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=300)
    started = asyncio.Event()
    tasks = [asyncio.create_task(stream_one(client, i, started)) for i in range(STREAMS)]
    if fault is not None:
        await asyncio.wait_for(started.wait(), 120)
        fault()
    _, pending = await asyncio.wait(tasks, timeout=HUNG_S)
    outcomes = []
    for task in tasks:
        if task in pending:
            task.cancel()
            outcomes.append(("hung", ""))
        elif task.exception() is not None:
            outcomes.append(("error", str(task.exception())))
        else:
            outcomes.append(("completed", task.result()))
    await client.close()
    return outcomes


@pytest.fixture(scope="module")
def reference(system: LocalSystem) -> list[str]:
    outcomes = asyncio.run(load(system.spec.router_url))
    assert all(o == "completed" for o, _ in outcomes), outcomes
    return [text for _, text in outcomes]


def restored(system: LocalSystem, timeout_s: float = 240) -> None:
    """Every child alive again (the supervisor restarts a killed one after its back-off),
    every planned instance registered, and a request goes through. Without the first check
    a 2-instance pool served through its survivor while the router still listed the dead
    one, and the next fault was sent to a process that no longer existed."""
    deadline = time.monotonic() + timeout_s
    want = system.spec.plan.num_instances
    while system.dead() or system.registered() < want:
        assert time.monotonic() < deadline, f"{system.registered()}/{want} back"
        time.sleep(0.5)
    body = {"model": "tiny-llava", "messages": messages(1), "max_tokens": 2}
    while True:
        answer = httpx.post(f"{system.spec.router_url}/v1/chat/completions", json=body, timeout=60)
        if answer.status_code == 200:
            return
        assert time.monotonic() < deadline, answer.text
        time.sleep(1)


@pytest.mark.parametrize("fault", ["kill", "freeze"])
@pytest.mark.parametrize("role", ["e", "p", "d"])
def test_no_stream_hangs_or_differs_when_a_role_dies_or_freezes(
    system: LocalSystem, reference: list[str], role: str, fault: str
) -> None:
    victim = system.process(f"test-{role}-0")

    def inject() -> None:
        sig = signal.SIGKILL if fault == "kill" else signal.SIGSTOP
        os.killpg(victim.popen.pid, sig)

    started = time.monotonic()
    outcomes = asyncio.run(load(system.spec.router_url, inject))
    elapsed = time.monotonic() - started
    if fault == "freeze":
        os.killpg(victim.popen.pid, signal.SIGCONT)
    counts = {k: sum(o == k for o, _ in outcomes) for k in ("completed", "error", "hung")}
    pools = system.spec.plan.pools
    line = {
        "pools": next(iter(pools.values())),
        "role": role.upper(),
        "fault": fault,
        **counts,
        "seconds": round(elapsed, 1),
        "errors": sorted({text[:120] for outcome, text in outcomes if outcome == "error"}),
    }
    print(json.dumps(line))
    if report := os.environ.get("EPD_FAULT_REPORT"):
        with open(report, "a") as out:
            out.write(json.dumps(line) + "\n")
    restored(system)

    assert counts["hung"] == 0, outcomes
    for index, (outcome, text) in enumerate(outcomes):
        if outcome == "completed":
            assert text == reference[index], (index, text, reference[index])
        else:
            assert text, "an error must say what went wrong"
