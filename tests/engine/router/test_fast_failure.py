"""A request makes progress or ends, fast (issue 12, items 4 and 5): against a real router
app on loopback, with instances registered by real heartbeats."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai

from epd_engine.config import internal_token
from tests.engine.router.live import SilentInstance, dispatcher, live_router
from tests.processes import free_port

TOKEN = {"X-EPD-Token": internal_token()}
CHAT = {"model": "tiny-llava", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def register(http: httpx.AsyncClient, router: str, instance_id: str, url: str) -> None:
    beat = {"instance_id": instance_id, "url": url, "role": "EPD", "pool": "epd"}
    answer = await http.post(f"{router}/internal/instances/heartbeat", json=beat, headers=TOKEN)
    answer.raise_for_status()


async def test_an_instance_refusing_connections_is_marked_down_at_once() -> None:
    """A crashed instance stayed in routing for 3 s of silence; every retry hit it."""
    async with live_router(instance_timeout_s=30) as (url, app), httpx.AsyncClient() as http:
        await register(http, url, "dead-0", f"http://127.0.0.1:{free_port()}")
        started = time.monotonic()
        answer = await http.post(f"{url}/v1/chat/completions", json=CHAT, timeout=10)
        elapsed = time.monotonic() - started
        registered = [i.instance_id for i in dispatcher(app).registry.all()]
    assert answer.status_code == 503, answer.text
    assert elapsed < 1.0
    assert registered == []


async def test_a_request_without_events_fails_by_the_watchdog() -> None:
    """A request whose holder froze hung for the router's 600 s timeout (200 and a role
    chunk, then nothing)."""
    async with (
        live_router(progress_timeout_s=1.0) as (url, _),
        SilentInstance() as frozen,
        httpx.AsyncClient() as http,
    ):
        await register(http, url, "frozen-0", frozen.url)
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
        started = time.monotonic()
        stream = await client.chat.completions.create(**CHAT, stream=True)  # type: ignore[call-overload]
        try:
            async for _ in stream:
                pass
            raise AssertionError("the stream ended without an error")
        except openai.APIError as exc:
            assert "no progress for 1 s" in str(exc)
        streaming_s = time.monotonic() - started
        await register(http, url, "frozen-0", frozen.url)  # it was not heartbeating
        answer = await http.post(f"{url}/v1/chat/completions", json=CHAT, timeout=10)
    assert streaming_s < 3
    assert answer.status_code == 503
    assert "no progress" in answer.json()["error"]["message"]


async def test_a_departed_client_gets_its_request_aborted_at_the_instance() -> None:
    """The router marked departed clients' requests aborted but never told the engines,
    which ran them on until they ran out of pages."""
    async with (
        live_router() as (url, _),
        SilentInstance() as instance,
        httpx.AsyncClient() as http,
    ):
        await register(http, url, "epd-0", instance.url)
        async with http.stream(
            "POST", f"{url}/v1/chat/completions", json={**CHAT, "stream": True}
        ) as response:
            assert response.status_code == 200
            async for _ in response.aiter_lines():
                break  # the role chunk, then the client leaves
        deadline = time.monotonic() + 1.0
        while not any(p.endswith("/abort") for p in instance.paths):
            assert time.monotonic() < deadline, instance.paths
            await asyncio.sleep(0.02)
    abort = next(p for p in instance.paths if p.endswith("/abort"))
    assert abort.startswith("/internal/requests/req-")


async def test_a_submit_to_an_instance_that_froze_is_given_up_when_it_is_marked_down() -> None:
    """A frozen encoder held every submit to it for the 60 s submit timeout."""

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(3600)

    frozen = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = frozen.sockets[0].getsockname()[1]
    async with live_router(instance_timeout_s=1.0) as (url, _), httpx.AsyncClient() as http:
        await register(http, url, "frozen-0", f"http://127.0.0.1:{port}")
        started = time.monotonic()
        answer = await http.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30)
        elapsed = time.monotonic() - started
    frozen.close()
    assert answer.status_code == 503, answer.text
    assert elapsed < 3.0


async def test_a_departed_non_streaming_client_gets_its_request_aborted_too() -> None:
    async with (
        live_router() as (url, _),
        SilentInstance() as instance,
        httpx.AsyncClient() as http,
    ):
        await register(http, url, "epd-0", instance.url)
        try:
            await http.post(f"{url}/v1/chat/completions", json=CHAT, timeout=0.5)
            raise AssertionError("a silent instance cannot have answered")
        except httpx.ReadTimeout:
            pass  # the client gives up and closes its connection
        deadline = time.monotonic() + 1.5
        while not any(p.endswith("/abort") for p in instance.paths):
            assert time.monotonic() < deadline, instance.paths
            await asyncio.sleep(0.02)


async def test_a_request_whose_instance_goes_down_mid_submit_is_sent_on_once() -> None:
    """The submit loop moved on to the next instance while the down-marking re-routed the
    same request: two copies of one attempt reached the pools, and the decode instance's
    step crashed on the duplicate ("internal engine error" for every request there)."""

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(3600)

    frozen = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    frozen_url = f"http://127.0.0.1:{frozen.sockets[0].getsockname()[1]}"
    async with (
        live_router(instance_timeout_s=1.0) as (url, _),
        SilentInstance() as healthy,
        httpx.AsyncClient() as http,
    ):
        await register(http, url, "a-frozen", frozen_url)  # chosen first (ties go by id)

        async def heartbeats() -> None:
            while True:
                await register(http, url, "b-healthy", healthy.url)
                await asyncio.sleep(0.2)

        beating = asyncio.create_task(heartbeats())
        await asyncio.sleep(0.1)  # both registered
        async with http.stream(
            "POST", f"{url}/v1/chat/completions", json={**CHAT, "stream": True}, timeout=10
        ) as response:
            assert response.status_code == 200
        await asyncio.sleep(0.5)
        beating.cancel()
        await asyncio.gather(beating, return_exceptions=True)
    frozen.close()
    assert healthy.paths.count("/internal/requests") == 1, healthy.paths
