"""One router replica as an instance sees it: heartbeats to it, its answer, its event stream.

Each replica has its own heartbeat loop and its own event stream, so a replica that is slow
or gone delays nothing sent to the others (its events wait in its own stream's buffer).
The heartbeat answer names the replica (``router_id``, the owner named in its request ids)
and lists the instances it routes to.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import httpx

from epd_engine.contracts.routing_policy import InstanceLoad
from epd_engine.disagg.event_stream import EventStream
from epd_engine.engine import startup

log = logging.getLogger(__name__)

HEARTBEAT_TIMEOUT_S = 5.0


class RouterEndpoint:
    def __init__(
        self,
        url: str,
        http: httpx.AsyncClient,
        headers: dict[str, str],
        heartbeat_s: float,
        on_named: Callable[[RouterEndpoint], None],
    ) -> None:
        self.url = url.rstrip("/")
        self.http = http
        self.headers = headers
        self.heartbeat_s = heartbeat_s
        self.on_named = on_named  # the replica's id was learned or changed (a restart)
        self.router_id: str | None = None
        self.instances: list[InstanceLoad] = []  # its last answer
        self.answering = False  # its last heartbeat was answered
        self.answered_s: float | None = None  # monotonic, the last answer
        self.num_failures = 0  # heartbeats in a row not answered
        self.events = EventStream(f"{self.url}/internal/event-stream", headers)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, load: Callable[[], InstanceLoad]) -> None:
        self._tasks = [
            asyncio.create_task(self._heartbeats(load)),
            asyncio.create_task(self.events.run()),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _heartbeats(self, load: Callable[[], InstanceLoad]) -> None:
        while True:
            await self.beat(load())
            await asyncio.sleep(self.heartbeat_s)

    async def beat(self, load: InstanceLoad) -> None:
        try:
            response = await self.http.post(
                f"{self.url}/internal/instances/heartbeat",
                json=load.to_json(),
                headers=self.headers,
                timeout=HEARTBEAT_TIMEOUT_S,
            )
            response.raise_for_status()
            answer = response.json()
            self.instances = [InstanceLoad.from_json(d) for d in answer["instances"]]
            router_id = answer.get("router_id")  # absent: a router that names no owner
        except (httpx.HTTPError, KeyError, ValueError, TypeError) as exc:
            self.num_failures += 1
            if self.num_failures == 1:  # once per outage, not every beat
                log.warning("heartbeat to %s failed: %r", self.url, exc)
            self.answering = False
            return
        self.answering = True
        self.num_failures = 0
        self.answered_s = time.monotonic()
        startup.mark("registered")
        if router_id != self.router_id:
            self.router_id = router_id
            self.on_named(self)
