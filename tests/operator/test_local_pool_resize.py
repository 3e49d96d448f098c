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
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx

from epd_engine.config import Role
from epd_operator.local.pools import LocalEngines, LocalPools
from epd_operator.rollout.pool_identity import PoolSpec
from tests.chat_clients import AskingClients
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
    clients = AskingClients(url, f"{MODEL}-emulated", MAX_TOKENS)

    with running(router_args, f"{url}/health/live", tmp_path / "router.log",
                 {"EPD_INTERNAL_TOKEN": token}):  # fmt: skip
        try:
            pools.apply_pool(_pool(3))
            _until(lambda: pools.observe_pools()["resize-epd-0"].ready == 3, "3 not Ready")
            clients.start()
            _until(lambda: len(clients.outcomes) >= 8, "no answers from three")
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
            answered = len(clients.outcomes)
            _until(lambda: len(clients.outcomes) >= answered + 8, "no answers after the resize")
        finally:
            clients.stop()
            pools.stop_all()
    assert not clients.failed, clients.failed
    print(f"{len(clients.outcomes)} answered, none failed")
    for gone in leaving:
        log = (tmp_path / "logs" / f"{gone}.log").read_text()
        assert "drained" in log, log[-2000:]  # left through the drain, not killed
    router_log = (tmp_path / "router.log").read_text()
    assert "re-routing" not in router_log, router_log[-3000:]
