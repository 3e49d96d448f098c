"""A SIGTERMed emulated instance (an emulated pod scaled away) drains as an engine does: it
leaves routing, finishes what it holds and exits by itself, so a scale-down of emulated pods
fails and re-routes nothing.

Defect prevented: an emulated instance ran plain ``uvicorn.run``, which on SIGTERM stopped
taking connections at once while the router still listed it (until 3 s of silent
heartbeats) and re-routed what it held.

Real processes on loopback: a router and two EPD emulated instances timed by the built-in
reference cost model (``--emulate reference``); four clients keep asking while one instance
gets SIGTERM.
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from pathlib import Path

import httpx

from tests.chat_clients import AskingClients
from tests.processes import free_port, running

MODEL = "llava-1.5-7b-emulated"
VICTIM = "emulated-0"
MAX_TOKENS = 96


def _held_by(url: str, instance_id: str, token: str) -> int:
    requests = httpx.get(f"{url}/internal/requests", headers={"X-EPD-Token": token})
    return sum(1 for r in requests.json()["requests"] if r["holder"] == instance_id)


def test_sigterm_under_traffic_fails_and_reroutes_nothing(tmp_path: Path) -> None:
    token = secrets.token_hex(16)
    env = {"EPD_INTERNAL_TOKEN": token}
    router_port = free_port()
    url = f"http://127.0.0.1:{router_port}"
    router_args = ["router", "--model", MODEL, "--port", str(router_port), "--log-level", "info"]
    ports = [free_port(), free_port()]

    def instance(index: int) -> list[str]:
        return ["serve", "--emulate", "reference", "--port", str(ports[index]),
                "--instance-id", f"emulated-{index}", "--router-url", url,
                "--drain-timeout", "60", "--log-level", "warning"]  # fmt: skip

    clients = AskingClients(url, MODEL, MAX_TOKENS)

    with (
        running(router_args, f"{url}/health/live", tmp_path / "router.log", env),
        running(
            instance(0), f"http://127.0.0.1:{ports[0]}/health/ready", tmp_path / "0.log", env
        ) as victim,
        running(instance(1), f"http://127.0.0.1:{ports[1]}/health/ready", tmp_path / "1.log", env),
    ):
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/health/ready").status_code != 200:
            assert time.monotonic() < deadline, "no emulated instance registered"
            time.sleep(0.1)
        clients.start()
        try:
            deadline = time.monotonic() + 30
            while _held_by(url, VICTIM, token) == 0:  # SIGTERM it while it decodes
                assert time.monotonic() < deadline, "the victim never held a request"
                time.sleep(0.02)
            held_at_sigterm = _held_by(url, VICTIM, token)
            os.kill(victim.pid, signal.SIGTERM)  # what the kubelet does: the process only
            terminated_s = time.monotonic()
            victim.wait(timeout=60)
            exited_after_s = time.monotonic() - terminated_s
            time.sleep(2.0)  # traffic goes on with the other instance
        finally:
            clients.stop()
    assert not clients.failed, clients.failed
    assert len(clients.outcomes) >= held_at_sigterm >= 1
    router_log = (tmp_path / "router.log").read_text()
    assert "re-routing" not in router_log, router_log[-3000:]
    victim_log = (tmp_path / "0.log").read_text()
    assert "drained: nothing in flight" in victim_log, victim_log[-2000:]
    assert "handing" not in victim_log  # nothing was left at the drain timeout
    assert exited_after_s < 30, exited_after_s
