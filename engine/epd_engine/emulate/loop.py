"""The emulated instance's iteration loop on the event loop: schedule, wait the batch's cost
model time (``asyncio.sleep``: an idle emulated fleet costs no CPU), update, hand each
request's events to its waiting handler.

Between instances (roles other than EPD) it tells its ``Handoffs`` of each pull the
scheduler issued and of each request parked for its next stage elsewhere; that request's
events end here (``generate`` returns without aborting it: it goes on at the target).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from typing import Protocol

from epd_engine.emulate.engine import EmulatedEngine
from epd_engine.emulate.instance_metrics import InstanceMetrics
from epd_engine.request import Request
from epd_engine.scheduler import RequestEvent
from epd_engine.scheduler.output import PullTask

IDLE_POLL_S = 0.001  # work queued but nothing schedulable (pages held): look again soon


class Handoffs(Protocol):
    """What the loop tells migration (``emulate/migration.py``)."""

    def on_pull(self, task: PullTask) -> None:
        """Pages were allocated for a migrated-in request: "move" its bytes."""
        ...

    def on_handoff(self, request: Request) -> None:
        """``request`` is parked here; its next stage runs on another instance."""
        ...

    def on_evicted(self, request_id: str) -> None:
        """A decode-only instance ran out of pages for it: send it down a fresh path."""
        ...


class EmulatedLoop:
    def __init__(self, engine: EmulatedEngine, metrics: InstanceMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self.handoffs: Handoffs | None = None  # set behind a router (roles other than EPD)
        # None in a stream: the request was handed off (its events go on at the target)
        self._streams: dict[str, asyncio.Queue[RequestEvent | None]] = {}
        self._offered: set[str] = set()  # parked requests already handed to migration
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def generate(self, request: Request) -> AsyncGenerator[RequestEvent, None]:
        """Queue ``request`` and yield its events until it finishes or is handed off
        (aborted if abandoned)."""
        queue: asyncio.Queue[RequestEvent | None] = asyncio.Queue()
        self.engine.add(request)  # ValueError: can never fit (the caller answers 400)
        self._streams[request.request_id] = queue
        self._wake.set()
        finished = False
        try:
            while not finished:
                event = await queue.get()
                finished = event is None or event.finish_reason is not None
                if event is not None:
                    yield event
        finally:
            self._streams.pop(request.request_id, None)
            if not finished:
                self.engine.abort(request.request_id)

    async def _run(self) -> None:
        engine = self.engine
        while True:
            if not engine.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            start = time.monotonic()
            step = engine.schedule()
            self._evict(step.out.evicted_ids)
            if step.out.is_empty:
                # as the engine's empty step: a request whose local stages need no work
                # (its image was in the encoder cache) parks for its next stage now
                engine.finish(step)
                self._hand_off_parked()
                await asyncio.sleep(IDLE_POLL_S)
                continue
            if self.handoffs is not None:
                for pull in step.out.pulls:  # their time runs beside this batch's
                    self.handoffs.on_pull(pull)
            await asyncio.sleep(max(0.0, step.duration_s - (time.monotonic() - start)))
            for event in engine.finish(step):
                queue = self._streams.get(event.request_id)
                if queue is not None:
                    queue.put_nowait(event)
            self._hand_off_parked()
            self.metrics.record_step(step, time.monotonic() - start)

    def wake(self) -> None:
        """Look at the scheduler again (a pull landed: its request can run)."""
        self._wake.set()

    def release(self, request_id: str) -> None:
        """The target has pulled a parked request: free its pages here."""
        self.engine.scheduler.release_migrated(request_id)
        self._offered.discard(request_id)

    def _evict(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if (queue := self._streams.get(request_id)) is not None:
                queue.put_nowait(None)  # its events end here, it goes on elsewhere
            if self.handoffs is not None:
                self.handoffs.on_evicted(request_id)

    def _hand_off_parked(self) -> None:
        migrating = self.engine.scheduler.migrating
        self._offered = {r for r in self._offered if r in migrating}  # not released since
        for request_id, request in migrating.items():
            if request_id in self._offered or self.handoffs is None:
                continue
            self._offered.add(request_id)
            queue = self._streams.get(request_id)
            if queue is not None:
                queue.put_nowait(None)
            self.handoffs.on_handoff(request)
