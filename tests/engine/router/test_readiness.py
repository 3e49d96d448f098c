"""A router replica is Ready only once it can start a text request.

The defect: ``/health/ready`` passed as soon as any instance had registered. A replica
restarted under an E+P+D (or EP+D) plan whose first heartbeat came from a decode instance
was Ready, so the Service (or the local balancer) sent it clients, and it answered them 503
"no ready instance can run prefill" until the prefill instance's heartbeat arrived. A real
router app on loopback; the instances are registered by real heartbeats (nothing listens at
their URLs: readiness reads only the registry).
"""

from __future__ import annotations

import asyncio

import httpx

from epd_engine.config import internal_token
from tests.engine.router.live import live_router

TOKEN = {"X-EPD-Token": internal_token()}
POOLS = ["e", "p", "d"]  # the routing a restarted replica starts with (router.json)


async def register(http: httpx.AsyncClient, router: str, role: str) -> None:
    load = {
        "instance_id": f"{role.lower()}-0",
        "url": "http://127.0.0.1:9",
        "role": role,
        "pool": role.lower(),  # the pool is named after its role here
    }
    beat = await http.post(f"{router}/internal/instances/heartbeat", json=load, headers=TOKEN)
    beat.raise_for_status()


async def test_ready_only_once_an_instance_that_prefills_is_registered() -> None:
    async with live_router(instance_timeout_s=60) as (url, _), httpx.AsyncClient() as http:
        assert (await http.get(f"{url}/health/ready")).status_code == 503  # none yet

        await register(http, url, "D")
        ready = await http.get(f"{url}/health/ready")
        assert ready.status_code == 503, ready.text
        chat = {"model": "tiny-llava", "messages": [{"role": "user", "content": "hi"}]}
        answer = await http.post(f"{url}/v1/chat/completions", json=chat)
        assert answer.status_code == 503  # what a client sent here would get
        assert "no ready instance can run prefill" in answer.text

        await register(http, url, "EP")
        ready = await http.get(f"{url}/health/ready")
        assert ready.status_code == 200, ready.text
        assert ready.json() == {"status": "ready", "instances": 2}


async def test_a_restarted_replica_waits_for_every_pool_of_its_routing() -> None:
    """The defect: a replica restarted under E+P+D with its last routing (the operator's
    router.json) was Ready once the prefill instance's heartbeat arrived, and answered image
    requests 503 until the encoder's came. Now it waits for every active pool, within the
    start-up grace."""
    routing = {"active_pools": ["e", "p", "d"], "startup_pool_grace_s": 60.0}
    async with (
        live_router(instance_timeout_s=60, **routing) as (url, _),
        httpx.AsyncClient() as http,
    ):
        await register(http, url, "P")
        await register(http, url, "D")
        waiting = await http.get(f"{url}/health/ready")
        assert waiting.status_code == 503, waiting.text
        assert waiting.json() == {"status": "active pools not registered yet", "pools": ["e"]}
        await register(http, url, "E")
        assert (await http.get(f"{url}/health/ready")).status_code == 200


async def test_a_dead_pool_holds_a_replica_out_only_for_the_grace() -> None:
    """A pool with no live instance (an encode pool down) must not keep text traffic away:
    after the grace the replica is Ready with what it has."""
    routing = {"active_pools": ["e", "p", "d"], "startup_pool_grace_s": 0.5}
    async with (
        live_router(instance_timeout_s=60, **routing) as (url, _),
        httpx.AsyncClient() as http,
    ):
        await register(http, url, "P")
        await register(http, url, "D")
        await asyncio.sleep(0.6)
        ready = await http.get(f"{url}/health/ready")
        assert ready.status_code == 200, ready.text
