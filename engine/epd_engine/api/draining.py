"""A terminating instance drains before it exits, so replacing a pod loses no request.

Kubernetes replaces a pod (a rolling update, a node drain, a scale-down) by sending its
process SIGTERM and, ``terminationGracePeriodSeconds`` later, SIGKILL. On SIGTERM
``DrainingServer`` keeps serving HTTP — peers still pull the caches of requests handed to
them, routers still send aborts — while ``leave_routing``:

1. says ``draining`` in its heartbeats to every router replica, which then send it no new
   request and leave it out of the instance table migration sources choose targets from
   (``Registry.active``); what they sent before is taken;
2. waits until it holds nothing (the instance says what that is: no request, no cache
   parked for a target to pull, every event answered) for two heartbeat periods in a row
   (a source that read the table just before may still offer it one);
3. at ``timeout_s`` hands back what is left: the owning router re-routes each request whose
   routing the instance still holds (``held``).

Then uvicorn's own shutdown runs. SIGINT (Ctrl-C, ``epdctl up`` stopping its processes) and
a second SIGTERM skip the drain. The engine (``server/drain.py``) and the emulated instance
(``emulate/drain.py``) each say what "holds nothing" means for them; neither imports the
other (an emulated instance imports no torch).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Protocol

import uvicorn

from epd_engine.disagg.router_link import RouterLink
from epd_engine.transfer.messages import Routing

log = logging.getLogger(__name__)

POLL_S = 0.05
ANNOUNCE_TIMEOUT_S = 5.0  # longest wait for the routers to hear "draining"
QUIET_HEARTBEATS = 2  # heartbeat periods holding nothing before the instance exits


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM runs ``drain`` before the usual shutdown."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self._loop is None or self._draining or self.should_exit:
            super().handle_exit(sig, frame)
            return
        # a signal handler runs between two bytecodes of the loop's thread: start the drain
        # from the loop itself
        self._loop.call_soon_threadsafe(self._start, sig)

    def _start(self, sig: int) -> None:
        if self._draining is None and not self.should_exit:
            self._draining = asyncio.ensure_future(self._drain_then_exit(sig))

    async def _drain_then_exit(self, sig: int) -> None:
        try:
            await self._drain()
        except Exception:  # a failed drain must not keep the process up
            log.exception("drain failed; shutting down")
        finally:
            super().handle_exit(sig, None)


class Drainable(Protocol):
    """What the drain reads of an instance's app state (the engine's and the emulator's)."""

    ready: bool
    link: RouterLink | None


async def leave_routing(
    state: Drainable,
    timeout_s: float,
    num_held: Callable[[], int],
    holds_nothing: Callable[[RouterLink], bool],
    held: Callable[[], Awaitable[list[Routing]]],
) -> None:
    """Turn readiness false, say ``draining``, wait until ``holds_nothing(link)`` for two
    heartbeats, else hand the routings ``held()`` back to their routers at ``timeout_s``."""
    state.ready = False
    link = state.link
    if link is None:  # no router: uvicorn's shutdown waits for open responses
        return
    log.warning("draining: no new requests; finishing %d in flight", num_held())
    deadline_s = time.monotonic() + timeout_s
    link.draining = True
    await _announced(link, min(deadline_s, time.monotonic() + ANNOUNCE_TIMEOUT_S))
    quiet_since: float | None = None
    while time.monotonic() < deadline_s:
        if holds_nothing(link):
            now = time.monotonic()
            quiet_since = quiet_since if quiet_since is not None else now
            if now - quiet_since >= QUIET_HEARTBEATS * link.heartbeat_s:
                log.warning("drained: nothing in flight; shutting down")
                return
        else:
            quiet_since = None
        await asyncio.sleep(POLL_S)
    routings = await held()
    log.warning("drain timed out: handing %d request(s) back to the router", len(routings))
    await asyncio.gather(
        *(link.retry(r, "its instance shut down before finishing it") for r in routings)
    )


def events_answered(link: RouterLink) -> bool:
    """Every event this instance sent a router was answered."""
    return not any(e.events.num_unanswered for e in link.endpoints.values())


async def _announced(link: RouterLink, deadline_s: float) -> None:
    """Until every answering replica answered two heartbeats since ``draining`` was set: the
    second of them was sent after the first came back, so it said ``draining``."""
    since = time.monotonic()
    answers: dict[str, set[float]] = {}
    while time.monotonic() < deadline_s:
        waiting = False
        for url, endpoint in link.endpoints.items():
            if endpoint.answered_s is not None and endpoint.answered_s > since:
                answers.setdefault(url, set()).add(endpoint.answered_s)
            if endpoint.answering and len(answers.get(url, ())) < 2:
                waiting = True
        if not waiting:
            return
        await asyncio.sleep(POLL_S)
