"""An instance that reports itself out of service leaves routing at once (issue 30, item 5):
a real router app on loopback, instances registered by real heartbeats. The instances are
``SilentInstance`` stand-ins (they take requests and say nothing), so the test can see where
the router sends a request; the engine side is tests/engine/disagg/test_broken_device.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx

from epd_engine.config import internal_token
from tests.engine.router.live import SilentInstance, dispatcher, live_router

TOKEN = {"X-EPD-Token": internal_token()}
CHAT = {"model": "tiny-llava", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def beat(
    http: httpx.AsyncClient, router: str, instance_id: str, url: str, unhealthy: str = ""
) -> list[str]:
    """One heartbeat; the instances the router answers with."""
    load = {"instance_id": instance_id, "url": url, "role": "EPD", "pool": "epd"}
    if unhealthy:
        load["unhealthy_reason"] = unhealthy
    answer = await http.post(f"{router}/internal/instances/heartbeat", json=load, headers=TOKEN)
    answer.raise_for_status()
    return sorted(i["instance_id"] for i in answer.json()["instances"])


async def test_an_out_of_service_heartbeat_takes_the_instance_out_and_reroutes_its_work() -> None:
    async with (
        live_router(instance_timeout_s=30) as (url, app),
        SilentInstance() as broken,
        SilentInstance() as healthy,
        httpx.AsyncClient() as http,
    ):
        await beat(http, url, "broken-0", broken.url)
        stream = asyncio.create_task(
            http.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": True}, timeout=10)
        )
        deadline = time.monotonic() + 5
        while not dispatcher(app).inflight or not broken.paths:
            assert time.monotonic() < deadline, "the request never reached the instance"
            await asyncio.sleep(0.01)
        (request,) = dispatcher(app).inflight.values()
        assert request.holder == "broken-0"
        await beat(http, url, "healthy-0", healthy.url)

        reason = "device error: CUDA error: an illegal memory access was encountered"
        table = await beat(http, url, "broken-0", broken.url, unhealthy=reason)
        assert table == ["healthy-0"]  # out at once, not after 30 s of silence
        deadline = time.monotonic() + 2
        while not healthy.paths:  # re-routed, as for an instance that died
            assert time.monotonic() < deadline, "the request stayed with the broken instance"
            await asyncio.sleep(0.01)
        assert request.holder == "healthy-0" and request.attempt == 1
        assert healthy.paths == ["/internal/requests"]

        # it keeps reporting the same until it restarts: it never comes back meanwhile
        assert await beat(http, url, "broken-0", broken.url, unhealthy=reason) == ["healthy-0"]
        registered = sorted(i.instance_id for i in dispatcher(app).registry.all())
        assert registered == ["healthy-0"]
        # restarted (a fresh process, healthy): back in routing
        assert await beat(http, url, "broken-0", broken.url) == ["broken-0", "healthy-0"]
        stream.cancel()
        with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
            await stream
