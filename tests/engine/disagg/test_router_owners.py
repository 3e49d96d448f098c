"""Several router replicas: an instance registers with each, and each request's events reach
the replica that owns it (its id names it), over real loopback HTTP to real router apps."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
from fastapi import FastAPI

from epd_engine.config import Role, internal_token
from epd_engine.contracts.request_owner import new_request_id, owner_of
from epd_engine.contracts.routing_policy import InstanceLoad
from epd_engine.disagg.router_directory import RouterDirectory, split_urls
from epd_engine.disagg.router_link import RouterLink
from epd_engine.local.ports import free_port
from epd_engine.transfer.messages import Routing
from tests.engine.router.live import dispatcher, live_router, track, wait_for_tokens
from tests.engine.server.test_router_link import idle_engine, output


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as client:
        yield client


def started_link(routers: RouterDirectory | list[str], http: httpx.AsyncClient) -> RouterLink:
    identity = InstanceLoad(instance_id="i-0", url="http://127.0.0.1:1", role=Role.EPD, pool="p")
    link = RouterLink(routers, identity, http, internal_token(), heartbeat_s=0.1, refresh_s=0.1)
    link.start(idle_engine())
    return link


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def send_tokens(link: RouterLink, router_request_id: str, count: int) -> None:
    routing = Routing(router_request_id=router_request_id)
    for n in range(1, count + 1):
        link.send(output(n, "length" if n == count else None), routing)


def owned_request_id(app: FastAPI) -> str:
    return new_request_id(dispatcher(app).router_id)


def test_a_request_id_names_its_router() -> None:
    assert owner_of(new_request_id("0123abcd")) == "0123abcd"
    assert owner_of("req-1") is None  # made elsewhere: names no replica
    assert split_urls(["http://a:1/, http://b:2", "http://c:3"]) == [
        "http://a:1",
        "http://b:2",
        "http://c:3",
    ]


async def test_a_headless_name_gives_one_url_per_address() -> None:
    async def resolver(host: str, port: int) -> list[str]:
        assert (host, port) == ("routers.ns.svc", 8080)
        return ["10.0.0.7", "fd00::7"]

    directory = RouterDirectory(["http://routers.ns.svc:8080"], resolve=True, resolver=resolver)
    assert await directory.replicas() == ["http://10.0.0.7:8080", "http://[fd00::7]:8080"]


async def test_each_replica_gets_only_its_own_requests_events_and_knows_the_instance(
    http: httpx.AsyncClient,
) -> None:
    async with live_router() as (url_a, app_a), live_router() as (url_b, app_b):
        link = started_link([url_a, url_b], http)
        replicas = {url_a: app_a, url_b: app_b}
        ids = {url: owned_request_id(app) for url, app in replicas.items()}
        requests = {url: track(app, ids[url]) for url, app in replicas.items()}
        await until(lambda: len(link._owners) == 2)
        for url in replicas:
            send_tokens(link, ids[url], 3)
        for request in requests.values():
            await wait_for_tokens(request, 3)
        for url, app in replicas.items():
            # 3 lines on this replica's stream: the other replica's events never came here
            assert dispatcher(app).events.last_seq(link.endpoints[url].events.session) == 3
            assert [i.instance_id for i in dispatcher(app).registry.all()] == ["i-0"]
        await link.stop()

    for request in requests.values():
        assert request.token_ids == [101, 102, 103]
        assert request.stage_s["decode"] == 3.0  # each event applied exactly once


async def test_a_replica_found_later_gets_heartbeats_and_the_events_that_waited_for_it(
    http: httpx.AsyncClient,
) -> None:
    """A migrated request can reach an instance before the instance has found its owner."""
    port_a, port_b = free_port(), free_port()
    b_listed = False

    async def resolver(host: str, port: int) -> list[str]:
        if host == "b.test" and not b_listed:
            raise OSError("no such name yet")
        return ["127.0.0.1"]

    names = [f"http://a.test:{port_a}", f"http://b.test:{port_b}"]
    directory = RouterDirectory(names, resolve=True, resolver=resolver)
    async with live_router(port_a) as (_, app_a), live_router(port_b) as (url_b, app_b):
        link = started_link(directory, http)
        await until(lambda: len(dispatcher(app_a).registry.all()) == 1)
        request = track(app_b, owned_request_id(app_b))
        send_tokens(link, request.router_request_id, 2)  # its owner is not known yet
        await asyncio.sleep(0.3)
        assert dispatcher(app_b).registry.all() == [] and request.token_ids == []

        b_listed = True
        await wait_for_tokens(request, 2)
        assert [i.instance_id for i in dispatcher(app_b).registry.all()] == ["i-0"]
        assert sorted(link.endpoints) == sorted([f"http://127.0.0.1:{port_a}", url_b])
        await link.stop()


async def test_a_dead_replica_delays_nothing_and_a_gone_one_is_let_go(
    http: httpx.AsyncClient,
) -> None:
    port_a, port_b = free_port(), free_port()
    listed = {"a.test", "b.test"}

    async def resolver(host: str, port: int) -> list[str]:
        if host not in listed:
            raise OSError("no such name")
        return ["127.0.0.1"]

    names = [f"http://a.test:{port_a}", f"http://b.test:{port_b}"]
    directory = RouterDirectory(names, resolve=True, resolver=resolver)
    async with live_router(port_a) as (url_a, app_a):
        async with live_router(port_b) as (url_b, _):
            link = started_link(directory, http)
            await until(lambda: len(link._owners) == 2)
        # b is gone (its pod ended) but still listed: a's requests go on as before
        request = track(app_a, owned_request_id(app_a))
        loop = asyncio.get_running_loop()
        sent_s = loop.time()
        send_tokens(link, request.router_request_id, 3)
        await wait_for_tokens(request, 3)
        assert loop.time() - sent_s < 1.0
        assert [i.instance_id for i in link.instances] == ["i-0"]  # b's table no longer counts

        listed.discard("b.test")  # and now it is unlisted too
        await until(lambda: list(link.endpoints) == [url_a])
        assert url_b not in link.endpoints
        await link.stop()
