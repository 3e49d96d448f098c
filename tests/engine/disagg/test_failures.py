"""Killing an instance mid-request never loses the request (DESIGN.md §4, §6).

Fault injection: ``EPD_FAULT_PULL_DELAY_S`` holds every pull for a few seconds so the test
can kill a process at a known point; nothing else about the system is faked.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from epd_engine.bench.process_cpu import cpu_seconds
from epd_engine.bench.static_system import LocalSystem
from epd_engine.config import Method, internal_token
from tests.engine.disagg.leaks import assert_nothing_leaked
from tests.engine.disagg.systems import local_system, plan_for
from tests.engine.server.images import image_message
from tests.engine.transfer.nixl_skip import backend_param

pytestmark = pytest.mark.slow
PULL_DELAY_S = 3.0


@pytest.fixture(scope="module", params=["shm", "tcp", "collective", backend_param("nixl")])
def system(
    request: pytest.FixtureRequest,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LocalSystem]:
    """E+P+D with three P instances on each backend (``auto`` is ``shm`` here)."""
    plan = plan_for(Method.E_P_D, {"P": 3})
    env = {"EPD_FAULT_PULL_DELAY_S": str(PULL_DELAY_S)}
    run_dir = tmp_path_factory.mktemp(f"failures-{request.param}")
    with local_system(
        tiny_model_dir, run_dir, plan, env, instance_timeout_s=1.5, transfer_backend=request.param
    ) as s:
        yield s


def ask(url: str, messages: list[dict[str, object]]) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    response = client.chat.completions.create(
        model="tiny-llava",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert response.usage is not None and response.usage.completion_tokens == 8
    return str(response.choices[0].message.content)


def inflight(url: str) -> list[dict[str, object]]:
    headers = {"X-EPD-Token": internal_token()}
    requests: list[dict[str, object]] = httpx.get(
        f"{url}/internal/requests", headers=headers
    ).json()["requests"]
    return requests


def kill_when(
    system: LocalSystem, pick: Callable[[dict[str, object]], str | None], timeout_s: float = 60
) -> str:
    """Wait until ``pick`` names an instance for the one in-flight request, then SIGKILL it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for request in inflight(system.spec.router_url):
            victim = pick(request)
            if victim is not None:
                os.killpg(system.process(victim).popen.pid, signal.SIGKILL)
                return victim
        time.sleep(0.05)
    raise TimeoutError("the request never reached the point to inject the fault")


def run_with_fault(
    system: LocalSystem,
    messages: list[dict[str, object]],
    pick: Callable[[dict[str, object]], str | None],
) -> tuple[str, str]:
    url = system.spec.router_url
    result: dict[str, str] = {}
    worker = threading.Thread(target=lambda: result.update(text=ask(url, messages)))
    worker.start()
    victim = kill_when(system, pick)
    worker.join(timeout=180)
    assert "text" in result, "the request did not complete"
    return result["text"], victim


def test_source_killed_before_kv_pull_request_completes_identically(system: LocalSystem) -> None:
    messages: list[dict[str, object]] = [{"role": "user", "content": "Tell me about rivers."}]
    expected = ask(system.spec.router_url, messages)

    def prefill_source_once_decode_holds(request: dict[str, object]) -> str | None:
        visited = [str(i) for i in request["instances"]]  # type: ignore[attr-defined]
        if visited and "-d-" in visited[-1]:
            return next(i for i in reversed(visited) if "-p-" in i)
        return None

    text, victim = run_with_fault(system, messages, prefill_source_once_decode_holds)
    assert "-p-" in victim
    assert text == expected
    assert_nothing_leaked(system)


def test_holder_killed_while_waiting_request_is_rerouted(system: LocalSystem) -> None:
    messages = [image_message("What is shown?", 7)]
    expected = ask(system.spec.router_url, messages)

    def prefill_holder(request: dict[str, object]) -> str | None:
        holder = str(request.get("holder") or "")
        alive = system.process(holder).popen.poll() is None if holder else False
        return holder if "-p-" in holder and alive else None

    text, victim = run_with_fault(system, messages, prefill_holder)
    assert "-p-" in victim
    assert text == expected
    assert_nothing_leaked(system)
    metrics = httpx.get(f"{system.spec.router_url}/metrics").text
    assert 'outcome="success"' in metrics


def test_an_instance_waiting_on_a_pull_sleeps(system: LocalSystem) -> None:
    """Defect: a request whose pages were still arriving counted as running work, so the
    target's engine thread ran ~50,000 empty steps a second for the whole pull."""
    url = system.spec.router_url
    worker = threading.Thread(
        target=ask, args=(url, [{"role": "user", "content": "Name a colour."}])
    )
    worker.start()
    deadline = time.monotonic() + 60
    holder = ""
    while "-d-" not in holder and time.monotonic() < deadline:  # D queued it; its pull is held
        holder = next((str(r["holder"]) for r in inflight(url)), "")
        time.sleep(0.02)
    assert "-d-" in holder, "the request never reached D"
    pid = system.process(holder).popen.pid
    before = cpu_seconds(pid)
    time.sleep(PULL_DELAY_S / 2)
    used = cpu_seconds(pid) - before
    worker.join(timeout=120)
    # heartbeats and the event loop cost milliseconds; a spinning engine thread a whole core
    assert used < 0.25 * PULL_DELAY_S / 2, f"{used:.2f} s of CPU in {PULL_DELAY_S / 2} s idle"
