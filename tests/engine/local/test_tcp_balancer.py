"""The local balancer in front of router replicas sends clients only to replicas that are
ready, as a Service lists only Ready pods.

The defect (CI, tests/operator/test_router_replica_killed.py): a router replica restarted
under traffic was given client connections as soon as it listened, before any instance had
registered with it, and answered them 503 "no ready instance can run prefill for this
request". Here two real router apps on loopback stand behind a real balancer: one with an
instance registered by a real heartbeat, one just started with none. The instance is a
``SilentInstance`` stand-in (it takes the request and says nothing): a stream's status line is
all this test reads.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from epd_engine.config import internal_token
from epd_engine.local.tcp_balancer import PROBE_EVERY_S, TcpBalancer
from tests.engine.router.live import SilentInstance, live_router
from tests.processes import free_port

TOKEN = {"X-EPD-Token": internal_token()}
CHAT = {
    "model": "tiny-llava",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 4,
    "stream": True,
}


async def register(router: str, instance_url: str) -> None:
    load = {"instance_id": "epd-0", "url": instance_url, "role": "EPD", "pool": "epd"}
    async with httpx.AsyncClient() as http:
        beat = await http.post(f"{router}/internal/instances/heartbeat", json=load, headers=TOKEN)
        beat.raise_for_status()


async def statuses(url: str, count: int) -> list[tuple[int, str]]:
    """``count`` streaming requests, a fresh connection each (the balancer spreads
    connections): each one's status and, when it failed, its message."""
    found = []
    for _ in range(count):
        async with (
            httpx.AsyncClient(timeout=10) as http,
            http.stream("POST", f"{url}/v1/chat/completions", json=CHAT) as answer,
        ):
            text = "" if answer.status_code == 200 else (await answer.aread()).decode()
            found.append((answer.status_code, text))
    return found


async def test_connections_go_only_to_ready_replicas_and_to_any_when_none_is() -> None:
    async with (
        live_router(instance_timeout_s=60) as (warm, _),
        live_router(instance_timeout_s=60) as (fresh, _),  # just restarted: knows no instance
        SilentInstance() as instance,
    ):
        await register(warm, instance.url)
        ports = [int(url.rsplit(":", 1)[1]) for url in (warm, fresh)]
        balancer = TcpBalancer("127.0.0.1", free_port(), [("127.0.0.1", p) for p in ports])
        await balancer.open()
        url = f"http://127.0.0.1:{balancer.port}"
        try:
            # every request reaches the replica that knows the instance
            assert await statuses(url, 8) == [(200, "")] * 8
            assert balancer.num_connections == [8, 0]

            # the instance registers with the other one: both take connections again
            await register(fresh, instance.url)
            deadline = time.monotonic() + 20 * PROBE_EVERY_S
            while balancer.ready != [True, True]:
                assert time.monotonic() < deadline, balancer.ready
                await asyncio.sleep(PROBE_EVERY_S / 5)
            assert await statuses(url, 8) == [(200, "")] * 8
            assert balancer.num_connections == [12, 4]
        finally:
            await balancer.close()


async def test_with_no_replica_ready_the_client_gets_the_routers_answer() -> None:
    """No instance anywhere (the run starting): the client still reaches a router, which
    says why, rather than having its connection reset."""
    async with live_router() as (first, _), live_router() as (second, _):
        ports = [int(url.rsplit(":", 1)[1]) for url in (first, second)]
        balancer = TcpBalancer("127.0.0.1", free_port(), [("127.0.0.1", p) for p in ports])
        await balancer.open()
        try:
            found = await statuses(f"http://127.0.0.1:{balancer.port}", 2)
        finally:
            await balancer.close()
        assert [status for status, _ in found] == [503, 503]
        assert all("no ready instance can run prefill" in text for _, text in found), found
        assert balancer.num_connections == [1, 1]
