"""KeepAliveClient against a real router app on loopback (its heartbeat endpoint): answers,
error statuses, connection reuse, a connection dropped while idle, no answer at all."""

from __future__ import annotations

import asyncio

import pytest

from epd_engine.config import internal_token
from epd_engine.router.keepalive_client import KeepAliveClient
from tests.engine.router.live import TcpProxy, live_router
from tests.processes import free_port

BEAT = {"instance_id": "i-0", "url": "http://127.0.0.1:1", "role": "EPD", "pool": "p"}
TOKEN = {"X-EPD-Token": internal_token()}


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def test_posts_answer_and_share_one_connection() -> None:
    async with live_router() as (url, _):
        proxy = TcpProxy(port_of(url))  # counts connections
        await proxy.open()
        client = KeepAliveClient()
        answers = [
            await client.post_json(f"{proxy.url}/internal/instances/heartbeat", BEAT, TOKEN, 10)
            for _ in range(5)
        ]
        client.close()
        await proxy.close()

    assert [a.status_code for a in answers] == [200] * 5
    assert answers[-1].json()["instances"][0]["instance_id"] == "i-0"
    assert proxy.num_connections == 1


async def test_error_statuses_come_back_as_answers() -> None:
    async with live_router() as (url, _):
        client = KeepAliveClient()
        heartbeat = f"{url}/internal/instances/heartbeat"
        forbidden = await client.post_json(heartbeat, BEAT, {"X-EPD-Token": "wrong"}, 10)
        invalid = await client.post_json(heartbeat, {"role": "EPD"}, TOKEN, 10)
        after = await client.post_json(heartbeat, BEAT, TOKEN, 10)
        client.close()

    assert forbidden.status_code == 403
    assert "X-EPD-Token" in forbidden.json()["error"]["message"]
    assert invalid.status_code == 400  # validation errors are 400s, as OpenAI answers them
    assert after.status_code == 200


async def test_a_connection_dropped_while_idle_is_replaced() -> None:
    async with live_router() as (url, _):
        proxy = TcpProxy(port_of(url))
        await proxy.open()
        client = KeepAliveClient()
        heartbeat = f"{proxy.url}/internal/instances/heartbeat"
        await client.post_json(heartbeat, BEAT, TOKEN, 10)
        proxy.cut()
        await asyncio.sleep(0.05)  # the reset reaches the client's loop

        answer = await client.post_json(heartbeat, BEAT, TOKEN, 10)
        client.close()
        await proxy.close()

    assert answer.status_code == 200
    assert proxy.num_connections == 2


async def test_concurrent_posts_each_get_a_connection_then_reuse_them() -> None:
    async with live_router() as (url, _):
        proxy = TcpProxy(port_of(url))
        await proxy.open()
        client = KeepAliveClient()
        heartbeat = f"{proxy.url}/internal/instances/heartbeat"
        for _ in range(3):
            await asyncio.gather(*(client.post_json(heartbeat, BEAT, TOKEN, 10) for _ in range(3)))
        client.close()
        await proxy.close()

    assert proxy.num_connections == 3


async def test_no_answer_times_out_and_nobody_listening_refuses() -> None:
    async def accept_and_say_nothing(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await reader.read()

    silent = await asyncio.start_server(accept_and_say_nothing, "127.0.0.1", free_port())
    silent_port = silent.sockets[0].getsockname()[1]
    client = KeepAliveClient()

    with pytest.raises(TimeoutError):
        await client.post_json(f"http://127.0.0.1:{silent_port}/x", {}, {}, timeout_s=0.2)
    with pytest.raises(OSError):
        await client.post_json(f"http://127.0.0.1:{free_port()}/x", {}, {}, timeout_s=1)
    silent.close()


async def test_idle_connections_to_an_origin_never_asked_again_are_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Defect (the soak: the router's descriptors grew by one or two per plan switch): a kept
    connection was closed only by the next request to its own origin, so one to a retired
    instance stayed open for good. A sweep over every origin closes it."""
    monkeypatch.setattr("epd_engine.router.keepalive_client.MAX_IDLE_S", 0.2)
    monkeypatch.setattr("epd_engine.router.keepalive_client.SWEEP_EVERY_S", 0.0)
    async with live_router() as (url, _):
        retired, serving = TcpProxy(port_of(url)), TcpProxy(port_of(url))
        await retired.open()
        await serving.open()
        client = KeepAliveClient()
        await client.post_json(f"{retired.url}/internal/instances/heartbeat", BEAT, TOKEN, 10)
        assert client.num_idle == 1
        (kept,) = client._idle[("127.0.0.1", port_of(retired.url), False)]
        await asyncio.sleep(0.3)  # idle past MAX_IDLE_S; its origin is never asked again
        await client.post_json(f"{serving.url}/internal/instances/heartbeat", BEAT, TOKEN, 10)
        assert kept.writer.is_closing()
        assert client.num_idle == 1  # the one just used, to the serving origin
        assert [o[1] for o in client._idle] == [port_of(serving.url)]
        client.close()
        await retired.close()
        await serving.close()
