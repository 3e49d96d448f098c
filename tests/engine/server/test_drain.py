"""A SIGTERMed engine (Kubernetes replacing its pod) drains: it leaves routing, finishes the
requests it holds and exits by itself, so a rolling update fails and re-routes nothing.

Real processes on 127.0.0.1: a router and E+P+D with two decode instances; clients keep
asking while one decode instance gets SIGTERM.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from epd_engine.bench.static_system import LocalSystem
from epd_engine.config import Method, Role, internal_token
from epd_engine.contracts.routing_policy import InstanceLoad
from epd_engine.router.registry import Registry
from tests.engine.disagg.systems import local_system, plan_for

VICTIM = "test-d-0"
MAX_TOKENS = 48


def test_a_draining_instance_takes_no_new_work_but_stays_known() -> None:
    registry = Registry(timeout_s=3.0)
    serving = InstanceLoad("d-0", "http://a", Role.D, "d")
    registry.heartbeat(serving)
    registry.heartbeat(InstanceLoad("d-1", "http://b", Role.D, "d", draining=True))
    assert [i.instance_id for i in registry.active()] == ["d-0"]
    assert registry.get("d-1") is not None  # its events and aborts still find it
    assert "draining" not in serving.to_json()  # an older peer would refuse the key
    echoed = InstanceLoad.from_json({**serving.to_json(), "draining": True, "later": 1})
    assert echoed.draining and echoed.instance_id == "d-0"


@pytest.fixture(scope="module")
def system(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSystem]:
    plan = plan_for(Method.E_P_D, {"D": 2})
    run_dir = tmp_path_factory.mktemp("drain")
    with local_system(tiny_model_dir, run_dir, plan, engine_args=("--drain-timeout", "60")) as s:
        yield s


def _held_by(url: str, instance_id: str) -> int:
    headers = {"X-EPD-Token": internal_token()}
    requests = httpx.get(f"{url}/internal/requests", headers=headers).json()["requests"]
    return sum(1 for r in requests if r["holder"] == instance_id)


@pytest.mark.slow
def test_sigterm_under_traffic_fails_and_reroutes_nothing(system: LocalSystem) -> None:
    url = system.spec.router_url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    outcomes: list[str] = []
    stop = threading.Event()

    def ask_until_stopped() -> None:
        while not stop.is_set():
            try:
                response = client.chat.completions.create(
                    model="tiny-llava",
                    messages=[{"role": "user", "content": "Tell me about rivers."}],
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                assert response.usage is not None
                ok = response.usage.completion_tokens == MAX_TOKENS
                outcomes.append("ok" if ok else f"short: {response.usage.completion_tokens}")
            except Exception as exc:
                outcomes.append(f"failed: {exc!r}")

    clients = [threading.Thread(target=ask_until_stopped) for _ in range(4)]
    for t in clients:
        t.start()
    try:
        deadline = time.monotonic() + 60
        while _held_by(url, VICTIM) == 0:  # SIGTERM it while it decodes
            assert time.monotonic() < deadline, "the victim never held a request"
            time.sleep(0.02)
        held_at_sigterm = _held_by(url, VICTIM)
        victim = system.process(VICTIM).popen
        os.kill(victim.pid, signal.SIGTERM)  # what the kubelet does: the process, not a group
        terminated_s = time.monotonic()
        victim.wait(timeout=60)
        exited_after_s = time.monotonic() - terminated_s
        time.sleep(2.0)  # traffic goes on with the other decode instance
    finally:
        stop.set()
        for t in clients:
            t.join(timeout=180)
    failed = [o for o in outcomes if o != "ok"]
    assert not failed, failed
    assert len(outcomes) >= held_at_sigterm >= 1
    router_log = (system.spec.run_dir / "logs" / "router.log").read_text()
    # without the drain the router re-routes what the victim held (0 failed, but redone)
    assert "re-routing" not in router_log, router_log[-3000:]
    victim_log = system.process(VICTIM).log.read_text()
    assert "drained: nothing in flight" in victim_log, victim_log[-2000:]
    assert "handing" not in victim_log  # nothing was left at the drain timeout
    assert exited_after_s < 30, exited_after_s
