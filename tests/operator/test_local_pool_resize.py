"""A local pool resized in place (``local/pools.py``): grown replicas join, removed ones drain.

The defect prevented: a local pool could only grow, and since a pool's count was in its name
every scale-down started a whole new pool beside the old one (holding both until the old
drained). Now ``apply_pool`` with fewer replicas SIGTERMs the removed ones, which leave
routing and finish what they hold; they keep their GPU until they exit, and a replica added
while they drain never takes an id a router still knows.

Real processes on loopback: a router and emulated instances timed by the built-in reference
cost model (``serve --emulate reference``), four clients asking all the while.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx
import openai

from epd_engine.config import Role
from epd_operator.local.pools import LocalEngines, LocalPools
from epd_operator.rollout.pool_identity import PoolSpec
from tests.processes import free_port, running

MODEL = "llava-1.5-7b"
MAX_TOKENS = 64


def _pool(replicas: int) -> PoolSpec:
    return PoolSpec("resize-epd-0", Role.EPD, replicas, gpus_per_instance=1)


T = TypeVar("T")


def _until(check: Callable[[], T], what: str, limit_s: float = 60) -> T:
    deadline = time.monotonic() + limit_s
    while not (got := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)
    return got


def _held_by(url: str, token: str, instance_ids: set[str]) -> int:
    listed = httpx.get(f"{url}/internal/requests", headers={"X-EPD-Token": token}).json()
    return sum(1 for r in listed["requests"] if r["holder"] in instance_ids)


def test_a_pool_shrinks_by_draining_and_grows_without_reusing_a_leaving_id(
    tmp_path: Path,
) -> None:
    token = secrets.token_hex(16)
    router_port = free_port()
    url = f"http://127.0.0.1:{router_port}"
    router_args = ["router", "--model", f"{MODEL}-emulated", "--port", str(router_port)]
    engines = LocalEngines(Path("unused"), MODEL, url, tmp_path, token, emulate=Path("reference"))
    pools = LocalPools(engines)
    outcomes: list[str] = []
    stop = threading.Event()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

    def ask_until_stopped() -> None:
        while not stop.is_set():
            try:
                answer = client.chat.completions.create(
                    model=f"{MODEL}-emulated",
                    messages=[{"role": "user", "content": "Tell me about rivers."}],
                    max_tokens=MAX_TOKENS,
                )
                got = answer.usage.completion_tokens if answer.usage else 0
                outcomes.append("ok" if got == MAX_TOKENS else f"short: {got}")
            except Exception as exc:
                outcomes.append(f"failed: {exc!r}")

    with running(router_args, f"{url}/health/live", tmp_path / "router.log",
                 {"EPD_INTERNAL_TOKEN": token}):  # fmt: skip
        clients = [threading.Thread(target=ask_until_stopped) for _ in range(4)]
        try:
            pools.apply_pool(_pool(3))
            _until(lambda: pools.observe_pools()["resize-epd-0"].ready == 3, "3 not Ready")
            for thread in clients:
                thread.start()
            _until(lambda: len(outcomes) >= 8, "no answers from three")
            newest = {"resize-epd-0-1", "resize-epd-0-2"}
            _until(lambda: _held_by(url, token, newest) >= 2, "the two to go held no request")

            pools.apply_pool(_pool(1))  # they drain what they hold
            shrunk = pools.observe_pools()["resize-epd-0"]
            assert (shrunk.replicas, shrunk.gpus) == (1, 3)  # the two leaving hold their GPUs
            kept = [t.instance_id for t in pools.timelines()]
            assert kept == ["resize-epd-0-0"]  # the oldest Ready replica stays
            leaving = pools.leaving()
            assert sorted(leaving) == ["resize-epd-0-1", "resize-epd-0-2"]

            pools.apply_pool(_pool(2))  # grown again while those two still drain
            added = [t.instance_id for t in pools.timelines()][1:]
            assert added == ["resize-epd-0-3"], added

            _until(lambda: not pools.leaving(), "the removed replicas did not exit")
            _until(
                lambda: pools.observe_pools()["resize-epd-0"].ready == 2,
                "the added replica did not serve",
            )
            after = pools.observe_pools()["resize-epd-0"]
            assert (after.replicas, after.gpus) == (2, 2)
            answered = len(outcomes)
            _until(lambda: len(outcomes) >= answered + 8, "no answers after the resize")
        finally:
            stop.set()
            for thread in clients:
                thread.join(timeout=120)
            pools.stop_all()
    failed = [o for o in outcomes if o != "ok"]
    assert not failed, failed
    print(f"{len(outcomes)} answered, none failed")
    for gone in leaving:
        log = (tmp_path / "logs" / f"{gone}.log").read_text()
        assert "drained" in log, log[-2000:]  # left through the drain, not killed
    router_log = (tmp_path / "router.log").read_text()
    assert "re-routing" not in router_log, router_log[-3000:]
