"""An instance's link to its routers: register + heartbeat load with every replica, and each
request's events to the replica that owns it.

A deployment may run several router replicas behind one Service. Each one routes client
requests to any instance, so every instance registers with every replica (``RouterDirectory``
says where they are; a headless Service's DNS lists them in Kubernetes), and a replica that
appears is sent heartbeats at once. A request's id names the replica that owns it
(``contracts/request_owner.py``); its events go on that replica's stream only. Events for an
owner not heard from yet (a replica this instance has not reached, met through a migrated
request) wait for it for a while; an id that names no owner goes to every replica.

The heartbeat answers list the instances each replica routes to; migration sources pick
their targets by load from their union.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from epd_engine.api.logprobs import logprob_content
from epd_engine.api.tokens import TOKEN_HEADER, internal_headers
from epd_engine.contracts.request_owner import owner_of
from epd_engine.contracts.routing_policy import InstanceLoad
from epd_engine.disagg.router_directory import RouterDirectory
from epd_engine.disagg.router_endpoint import RouterEndpoint
from epd_engine.timing import clock_domain
from epd_engine.transfer.messages import Routing

if TYPE_CHECKING:  # types only: the link itself imports no torch (emulated instances use it)
    from epd_engine.engine.async_engine import RequestOutput
    from epd_engine.engine.llm_engine import LLMEngine, StageTiming

log = logging.getLogger(__name__)

OWNER_WAIT_S = 30.0  # events for a replica not heard from yet are kept this long
RETRY_TIMEOUT_S = 10.0


@dataclass
class _Waiting:
    """Events for an owner not known yet, in the order they were sent."""

    since_s: float
    events: list[dict[str, object]] = field(default_factory=list)


class RouterLink:
    def __init__(
        self,
        routers: str | Sequence[str] | RouterDirectory,
        identity: InstanceLoad,
        http: httpx.AsyncClient,
        token: str,
        heartbeat_s: float = 0.5,
        token_text: Callable[[int], str] | None = None,
        refresh_s: float = 2.0,
        owner_wait_s: float = OWNER_WAIT_S,
    ) -> None:
        if isinstance(routers, str):
            routers = [routers]
        self.directory = (
            routers if isinstance(routers, RouterDirectory) else RouterDirectory(routers)
        )
        self.identity = identity
        self.http = http
        self.headers = {**internal_headers(), TOKEN_HEADER: token}
        self.heartbeat_s = heartbeat_s
        self.refresh_s = refresh_s  # how often the directory is read (a new replica found)
        self.owner_wait_s = owner_wait_s
        # one token's text: logprobs go to the router rendered (it has no tokenizer)
        self.token_text = token_text
        # shutting down (server/drain.py): heartbeats say so, and routers send us nothing new
        self.draining = False
        self.endpoints: dict[str, RouterEndpoint] = {}  # url -> replica
        self._owners: dict[str, RouterEndpoint] = {}  # router id -> replica
        self._waiting: dict[str, _Waiting] = {}  # router id -> events for it
        self._load: Callable[[], InstanceLoad] | None = None
        self._refresher: asyncio.Task[None] | None = None

    @property
    def instances(self) -> list[InstanceLoad]:
        """Every instance some answering replica routes to (the first replica's load wins)."""
        seen: dict[str, InstanceLoad] = {}
        for endpoint in self.endpoints.values():
            if endpoint.answering:
                for load in endpoint.instances:
                    seen.setdefault(load.instance_id, load)
        return list(seen.values())

    def start(self, engine: LLMEngine) -> None:
        self._load = lambda: self.load(engine)
        if not self.directory.resolve:  # fixed replicas: known now, before the first refresh
            for url in self.directory.urls:
                self._add(url)
        self._refresher = asyncio.create_task(self._refresh_forever())

    async def stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)
        await asyncio.gather(*(e.stop() for e in self.endpoints.values()))

    def load(self, engine: LLMEngine) -> InstanceLoad:
        s = engine.scheduler
        return InstanceLoad(
            instance_id=self.identity.instance_id,
            url=self.identity.url,
            role=self.identity.role,
            pool=self.identity.pool,
            num_waiting=len(s.waiting),
            num_running=len(s.running),
            free_kv_blocks=s.kv.pool.num_free if s.kv else 0,
            free_image_blocks=s.images.pool.num_free if s.images else 0,
            # out of service (engine/health.py): the router takes us out of routing at once
            unhealthy_reason=engine.health.check() or "",
            draining=self.draining,
            node=self.identity.node,
            group=self.identity.group,
        )

    # --- replicas coming and going ----------------------------------------------------------

    async def _refresh_forever(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.refresh_s)

    async def refresh(self) -> None:
        """Start on replicas the directory lists now; let go of unlisted ones that stopped
        answering (one still answering may be draining: its requests need their events)."""
        listed = await self.directory.replicas() if self.directory.resolve else self.directory.urls
        for url in listed:
            if url not in self.endpoints:
                log.info("router replica %s found", url)
                self._add(url)
        for url, endpoint in list(self.endpoints.items()):
            if url not in listed and not endpoint.answering:
                log.info("router replica %s gone", url)
                del self.endpoints[url]
                await endpoint.stop()  # its unsent events: its requests are gone with it
                self._index_owners()
        now = time.monotonic()
        for owner, waiting in list(self._waiting.items()):
            if now - waiting.since_s > self.owner_wait_s:
                del self._waiting[owner]
                log.warning(
                    "dropping %d events for router %s: no replica answers as it",
                    len(waiting.events),
                    owner,
                )

    def _add(self, url: str) -> None:
        assert self._load is not None
        endpoint = RouterEndpoint(
            url, self.http, self.headers, self.heartbeat_s, lambda _: self._index_owners()
        )
        self.endpoints[url] = endpoint
        endpoint.start(self._load)

    def _index_owners(self) -> None:
        """Which replica is which router id (a replica listed twice: the first); then send
        what waited for an owner now known."""
        owners: dict[str, RouterEndpoint] = {}
        for endpoint in self.endpoints.values():
            if endpoint.router_id is not None:
                owners.setdefault(endpoint.router_id, endpoint)
        self._owners = owners
        for owner in [o for o in self._waiting if o in owners]:
            for event in self._waiting.pop(owner).events:
                owners[owner].events.put(event)

    # --- events -----------------------------------------------------------------------------

    def send(self, output: RequestOutput, routing: Routing) -> None:
        """Queue one output for its router (loop thread); one stream per replica keeps the
        order of a request's events."""
        event: dict[str, Any] = {
            "router_request_id": routing.router_request_id,
            "attempt": routing.attempt,
            "instance_id": self.identity.instance_id,
            "pool": self.identity.pool,
            "token_ids": output.new_token_ids,
            "text_delta": output.text_delta,
            "num_prompt_tokens": output.num_prompt_tokens,
            "num_output_tokens": output.num_output_tokens,
            "num_cached_tokens": output.num_cached_tokens,
            "finish_reason": output.finish_reason,
            "error": output.error,
            "stage_timings": [_timing_json(t) for t in output.stage_timings],
        }
        if output.logprobs and self.token_text is not None:
            content = logprob_content(output.new_token_ids, output.logprobs, self.token_text)
            event["logprobs"] = [entry.model_dump() for entry in content]
        self.send_raw(event)

    def send_raw(self, event: dict[str, object]) -> None:
        owner = owner_of(str(event["router_request_id"]))
        if owner is None:  # names no replica: each gets it, the owner applies it
            for endpoint in self.endpoints.values():
                endpoint.events.put(event)
            return
        owning = self._owners.get(owner)
        if owning is not None:
            owning.events.put(event)
        else:
            self._waiting.setdefault(owner, _Waiting(time.monotonic())).events.append(event)

    async def retry(self, routing: Routing, reason: str) -> None:
        """Ask the owning router to send the request down a fresh path (this instance
        cannot go on)."""
        owner = owner_of(routing.router_request_id)
        deadline_s = time.monotonic() + RETRY_TIMEOUT_S
        while owner is not None and owner not in self._owners:
            if time.monotonic() > deadline_s:
                log.error("cannot retry %s: router %s unknown", routing.router_request_id, owner)
                return
            await asyncio.sleep(self.heartbeat_s / 2)
        targets = [self._owners[owner]] if owner is not None else list(self.endpoints.values())
        for endpoint in targets:
            try:
                await self.http.post(
                    f"{endpoint.url}/internal/requests/{routing.router_request_id}/retry",
                    json={"attempt": routing.attempt, "reason": reason},
                    headers=self.headers,
                    timeout=RETRY_TIMEOUT_S,
                )
            except httpx.HTTPError as exc:
                log.error(
                    "cannot ask %s to retry %s: %r", endpoint.url, routing.router_request_id, exc
                )


def _timing_json(timing: StageTiming) -> dict[str, Any]:
    """One stage's timing for the router; with its monotonic marks and this host's clock
    domain when known (the router compares marks only within its own domain)."""
    data: dict[str, Any] = {
        "stage": timing.stage.value,
        "queue_s": timing.queue_s,
        "exec_s": timing.exec_s,
    }
    if timing.ready_at is not None and timing.end_at is not None and (clock := clock_domain()):
        data.update(ready_at=timing.ready_at, end_at=timing.end_at, clock=clock)
    return data
