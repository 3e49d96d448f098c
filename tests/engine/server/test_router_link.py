"""RouterLink's token events reach a real router, over real loopback HTTP, exactly once and in
order: across a cut connection, an unreachable router and a router restart."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from epd_engine.config import Role, Stage, internal_token
from epd_engine.contracts.routing_policy import InstanceLoad
from epd_engine.disagg.router_link import RouterLink
from epd_engine.engine.async_engine import RequestOutput
from epd_engine.engine.health import EngineHealth
from epd_engine.engine.llm_engine import StageTiming
from epd_engine.transfer.messages import Routing
from tests.engine.router.live import TcpProxy, live_router, track, wait_for_tokens


def idle_engine() -> Any:
    """All RouterLink reads from an engine, for heartbeats: its scheduler's load and its
    health (a real EngineHealth: in service)."""
    scheduler = SimpleNamespace(waiting=[], running=[], kv=None, images=None)
    return SimpleNamespace(scheduler=scheduler, health=EngineHealth(stall_timeout_s=None))


def output(n: int, finish: str | None = None) -> RequestOutput:
    """The ``n``-th token's output, with one second of decode time to count deliveries by."""
    return RequestOutput(
        "r", f"t{n} ", [100 + n], 3, n, finish, None, [StageTiming("r", Stage.DECODE, 0.0, 1.0)]
    )


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as client:
        yield client


async def started_link(url: str, http: httpx.AsyncClient) -> RouterLink:
    identity = InstanceLoad(instance_id="i-0", url="http://127.0.0.1:1", role=Role.EPD, pool="p")
    link = RouterLink(url, identity, http, internal_token(), heartbeat_s=0.2)
    link.start(idle_engine())
    return link


async def test_tokens_arrive_in_order_once_across_a_cut_connection(
    http: httpx.AsyncClient,
) -> None:
    async with live_router() as (url, app):
        proxy = TcpProxy(int(url.rsplit(":", 1)[1]))
        await proxy.open()
        link = await started_link(proxy.url, http)
        request = track(app, "req-1")
        routing = Routing(router_request_id="req-1")
        for n in range(1, 6):
            link.send(output(n), routing)
        await wait_for_tokens(request, 5)

        proxy.cut()  # applied, maybe not yet acknowledged: the sender re-sends them
        for n in range(6, 11):
            link.send(output(n, "length" if n == 10 else None), routing)
        await wait_for_tokens(request, 10)
        await link.stop()

    assert request.token_ids == [100 + n for n in range(1, 11)]
    assert request.text == "".join(f"t{n} " for n in range(1, 11))
    assert request.finish_reason == "length"
    assert request.stage_s["decode"] == 10.0  # each event applied exactly once


async def test_events_sent_while_the_router_is_unreachable_arrive_later(
    http: httpx.AsyncClient,
) -> None:
    async with live_router() as (url, app):
        proxy = TcpProxy(int(url.rsplit(":", 1)[1]))
        await proxy.open()
        link = await started_link(proxy.url, http)
        request = track(app, "req-1")
        routing = Routing(router_request_id="req-1")

        await proxy.close()  # longer than a few retries: these must wait, not be dropped
        for n in range(1, 4):
            link.send(output(n), routing)
        await asyncio.sleep(4.0)
        await proxy.open()
        await wait_for_tokens(request, 3)
        await link.stop()

    assert request.token_ids == [101, 102, 103]
    assert request.stage_s["decode"] == 3.0


async def test_a_restarted_router_gets_the_events_of_its_new_requests(
    http: httpx.AsyncClient,
) -> None:
    async with live_router() as (url, app):
        port = int(url.rsplit(":", 1)[1])
        link = await started_link(url, http)
        before = track(app, "req-1")
        link.send(output(1), Routing(router_request_id="req-1"))
        await wait_for_tokens(before, 1)

    async with live_router(port) as (_, app):  # same address, nothing in flight
        after = track(app, "req-2")
        for n in range(1, 4):
            link.send(output(n), Routing(router_request_id="req-2"))
        await wait_for_tokens(after, 3)
        await link.stop()

    assert after.token_ids == [101, 102, 103]


async def test_the_event_stream_needs_the_internal_token(http: httpx.AsyncClient) -> None:
    async with live_router() as (url, app):
        request = track(app, "req-1")
        event = {"seq": 1, "router_request_id": "req-1", "token_ids": [1], "num_output_tokens": 1}
        response = await http.post(
            f"{url}/internal/event-stream",
            content=json.dumps(event).encode() + b"\n",
            headers={"X-EPD-Token": "wrong", "X-EPD-Event-Session": "s"},
        )

    assert response.status_code == 403
    assert request.token_ids == []


def test_a_stage_timing_carries_its_marks_and_clock_domain() -> None:
    from epd_engine.disagg.router_link import _timing_json
    from epd_engine.timing import clock_domain

    data = _timing_json(StageTiming("r", Stage.PREFILL, 0.5, 1.0, 10.0, 11.5))
    assert data["stage"] == "prefill" and data["queue_s"] == 0.5 and data["exec_s"] == 1.0
    if clock_domain():  # Linux
        assert (data["ready_at"], data["end_at"], data["clock"]) == (10.0, 11.5, clock_domain())
    bare = _timing_json(StageTiming("r", Stage.PREFILL, 0.5, 1.0))
    assert set(bare) == {"stage", "queue_s", "exec_s"}
