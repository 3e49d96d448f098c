"""The emulated instance's iteration loop on the event loop: schedule, wait the batch's cost
model time (``asyncio.sleep``: an idle emulated fleet costs no CPU), update, hand each
request's events to its waiting handler."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator

from epd_engine.emulate.engine import EmulatedEngine
from epd_engine.emulate.instance_metrics import InstanceMetrics
from epd_engine.request import Request
from epd_engine.scheduler import RequestEvent

IDLE_POLL_S = 0.001  # work queued but nothing schedulable (pages held): look again soon


class EmulatedLoop:
    def __init__(self, engine: EmulatedEngine, metrics: InstanceMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self._streams: dict[str, asyncio.Queue[RequestEvent]] = {}
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
        """Queue ``request`` and yield its events until it finishes (aborted if abandoned)."""
        queue: asyncio.Queue[RequestEvent] = asyncio.Queue()
        self.engine.add(request)  # ValueError: can never fit (the caller answers 400)
        self._streams[request.request_id] = queue
        self._wake.set()
        finished = False
        try:
            while not finished:
                event = await queue.get()
                finished = event.finish_reason is not None
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
            if step.out.is_empty:
                await asyncio.sleep(IDLE_POLL_S)
                continue
            await asyncio.sleep(max(0.0, step.duration_s - (time.monotonic() - start)))
            for event in engine.finish(step):
                queue = self._streams.get(event.request_id)
                if queue is not None:
                    queue.put_nowait(event)
            self.metrics.record_step(step, time.monotonic() - start)
