"""Runs LLMEngine in a background thread and streams per-request outputs to asyncio.

The event loop never blocks on the model: requests and aborts cross into the engine thread
through a queue; tokens come back with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from epd_engine.detokenizer import Detokenizer
from epd_engine.engine import LLMEngine, StepStats
from epd_engine.errors import ClientError
from epd_engine.processor import PreparedPrompt
from epd_engine.request import RequestStatus
from epd_engine.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    request_id: str
    text_delta: str
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class _Stream:
    queue: asyncio.Queue[RequestOutput]
    loop: asyncio.AbstractEventLoop
    detokenizer: Detokenizer
    num_prompt_tokens: int
    num_output_tokens: int = 0


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        decode: Callable[[list[int]], str],
        on_step: Callable[[StepStats], None] | None = None,
    ) -> None:
        self.engine = engine
        self._decode = decode
        self._on_step = on_step
        self._inbox: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="epd-engine", daemon=True)
        self.num_running = 0
        self.num_waiting = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._inbox.put(lambda: None)
        self._thread.join(timeout=10)

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    async def generate(
        self,
        request_id: str,
        prompt: PreparedPrompt,
        sampling: SamplingParams,
        eos_token_ids: frozenset[int],
    ) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        stream = _Stream(
            asyncio.Queue(), loop, Detokenizer(self._decode, sampling.stop), len(prompt.token_ids)
        )
        added: asyncio.Future[None] = loop.create_future()

        def add() -> None:
            try:
                self.engine.add_request(request_id, prompt, sampling, eos_token_ids)
            except ValueError as exc:
                loop.call_soon_threadsafe(_set_exception, added, ClientError(str(exc)))
                return
            self._streams[request_id] = stream
            loop.call_soon_threadsafe(_set_result, added)

        self._inbox.put(add)
        await added
        finished = False
        try:
            while True:
                output = await stream.queue.get()
                yield output
                if output.finish_reason is not None:
                    finished = True
                    return
        finally:
            if not finished:  # client went away: free the pages now
                self._inbox.put(lambda: self._abort(request_id))

    def _abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.engine.abort(request_id)

    def _loop(self) -> None:
        while not self._stopping.is_set():
            block = not self.engine.has_work()
            try:
                while True:
                    self._inbox.get(block=block, timeout=0.5 if block else None)()
                    block = False
            except queue.Empty:
                pass
            if not self.engine.has_work():
                continue
            try:
                events, stats = self.engine.step()
            except Exception:  # a bug must not hang clients: fail everything in flight
                log.exception("engine step failed")
                self._fail_all("internal engine error")
                continue
            self.num_running = len(self.engine.scheduler.running)
            self.num_waiting = len(self.engine.scheduler.waiting)
            if self._on_step is not None:
                self._on_step(stats)
            for event in events:
                self._deliver(event.request_id, event.new_token_id, event.finish_reason)

    def _deliver(self, request_id: str, token_id: int | None, finish_reason: str | None) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        delta = ""
        if token_id is not None:
            stream.num_output_tokens += 1
            delta = stream.detokenizer.add(token_id, final=finish_reason is not None)
            if stream.detokenizer.stopped and finish_reason is None:
                finish_reason = "stop"
                self.engine.scheduler.finish(request_id, RequestStatus.FINISHED_STOPPED)
                self.engine.abort(request_id)
        output = RequestOutput(
            request_id, delta, stream.num_prompt_tokens, stream.num_output_tokens, finish_reason
        )
        if finish_reason is not None:
            self._streams.pop(request_id, None)
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, output)

    def _fail_all(self, message: str) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id)
            output = RequestOutput(
                request_id,
                "",
                stream.num_prompt_tokens,
                stream.num_output_tokens,
                finish_reason="error",
                error=message,
            )
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, output)
        self._streams.clear()


def _set_result(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _set_exception(future: asyncio.Future[None], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
