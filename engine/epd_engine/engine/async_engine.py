"""Runs LLMEngine in a background thread and streams per-request outputs to asyncio.

The event loop never blocks on the model: work crosses into the engine thread through an
inbox of callables; outputs come back into each request's sink (a local queue for a direct
client, or the router link when a router owns the request) in one batch per step and event
loop: a single ``loop.call_soon_threadsafe`` (one wake-up of the loop, a socket write)
carries every request's output of the step, in order, not one per token. Detokenizing
happens there too, on the event loop, off the engine thread: a stop string found in the text
ends the request through the inbox (the engine may have made one more token by then; the
client never sees it). After every step the engine thread also reports migrations to start:
requests whose next stage lives elsewhere (handoffs) and pages to pull (pulls), each after
the outputs before it.

Health (``health.py``): the engine thread marks its progress; after a sticky device error
it ends its work (clients it serves directly get an error; the router re-routes its own
requests once told, by the heartbeat) and refuses new requests. ``watch`` on the event loop
finds a stalled or dead engine thread and fails the direct clients that thread cannot.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import TypeVar

from epd_engine.contracts.errors import ClientError, ServiceUnavailable
from epd_engine.engine.detokenizer import Detokenizer
from epd_engine.engine.llm_engine import REQUEST_FAILED, LLMEngine, StageTiming, StepStats
from epd_engine.engine.step_phases import PUBLISH
from epd_engine.inputs.processor import PreparedPrompt
from epd_engine.request import Request
from epd_engine.sampling import SamplingParams, TokenLogprobs
from epd_engine.scheduler import RequestEvent
from epd_engine.scheduler.output import PullTask
from epd_engine.transfer.messages import Routing

log = logging.getLogger(__name__)
# An idle engine thread still looks at its inbox this often (a safety net: every state
# change reaches it through the inbox, which wakes it at once).
IDLE_WAKE_S = 1.0
T = TypeVar("T")


@dataclass
class RequestOutput:
    request_id: str
    text_delta: str
    new_token_ids: list[int]
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None = None
    error: str | None = None
    stage_timings: list[StageTiming] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per new token, if asked
    num_cached_tokens: int = 0  # prompt tokens served from this instance's cache
    published_s: float = 0.0  # monotonic time the event loop received it (token timing)


Sink = Callable[[RequestOutput], None]


class FinalWake:
    """A request's outputs for a client that wants only the whole answer: each is kept as
    it arrives and the reader wakes once, at the last (a wake-up per step and request is
    event-loop time, and the loop shares the GIL with the engine thread)."""

    def __init__(self) -> None:
        self._outputs: list[RequestOutput] = []
        self._done = asyncio.Event()

    def put_nowait(self, output: RequestOutput) -> None:
        self._outputs.append(output)
        if output.finish_reason is not None:
            self._done.set()

    async def get(self) -> RequestOutput:
        if not self._done.is_set():
            await self._done.wait()
        return self._outputs.pop(0)


@dataclass
class RequestOutputStream:
    """Where one request's outputs go, and what the client has been sent so far. The
    detokenizer, ``num_output_tokens`` and ``finished`` belong to the event loop (the engine
    thread sets them only while no output of the request is on the way: at admission, or
    when a pull lands)."""

    sink: Sink
    loop: asyncio.AbstractEventLoop
    detokenizer: Detokenizer
    num_prompt_tokens: int
    num_output_tokens: int = 0
    routing: Routing | None = None
    pending_timings: list[StageTiming] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = False  # its last output went to the sink: drop any later one


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        decode: Callable[[list[int]], str],
        on_step: Callable[[StepStats], None] | None = None,
    ) -> None:
        self.engine = engine
        self.decode = decode
        self._on_step = on_step
        self.on_handoff: Callable[[Request, RequestOutputStream], None] | None = None
        self.on_pull: Callable[[PullTask], None] | None = None
        self.on_evicted: Callable[[RequestOutputStream], None] | None = None
        self._inbox: queue.Queue[Callable[[], None]] = queue.Queue()
        self.streams: dict[str, RequestOutputStream] = {}
        # outputs not yet handed to their loops; _flush sends them, one call per loop
        self._outbox: dict[
            asyncio.AbstractEventLoop, list[tuple[RequestOutputStream, RequestOutput]]
        ] = {}
        self.num_steps = 0  # iterations run (idle ones included), for tests and metrics
        self.health = engine.health
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="epd-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._inbox.put(lambda: None)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():  # else a step still runs on what close would stop
            self.engine.close()

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the engine thread between steps (the only thread touching the engine)."""
        self._inbox.put(fn)

    async def call_async(self, fn: Callable[[], object]) -> object:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[object] = loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except BaseException as exc:  # handed back to the awaiting coroutine
                loop.call_soon_threadsafe(_set_exception, future, exc)
            else:
                loop.call_soon_threadsafe(_set_result, future, result)

        self.call(run)
        return await future

    async def add(self, make_request: Callable[[], Request], stream: RequestOutputStream) -> None:
        """Queue a request on the engine thread; admission errors come back as ClientError
        (ServiceUnavailable, 503, while the instance is out of service)."""
        self.check_health_or_refuse()

        def add() -> None:
            self.check_health_or_refuse()  # it may have broken meanwhile
            request = make_request()
            self.streams[request.request_id] = stream

        try:
            await self.call_async(add)
        except ValueError as exc:
            raise ClientError(str(exc)) from exc

    async def generate(
        self,
        request_id: str,
        prompt: PreparedPrompt,
        sampling: SamplingParams,
        eos_token_ids: frozenset[int],
        incremental: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """Serve one request directly to a local client: each step's output as it comes
        (``incremental``), or all of them at once when the last has come."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] | FinalWake = (
            asyncio.Queue() if incremental else FinalWake()
        )
        # a client of the whole answer without stop strings needs no text before the end
        whole_text_only = not incremental and not sampling.stop
        stream = RequestOutputStream(
            outputs.put_nowait,
            loop,
            Detokenizer(self.decode, sampling.stop, sampling.min_tokens, whole_text_only),
            len(prompt.token_ids),
        )
        await self.add(
            lambda: self.engine.add_request(request_id, prompt, sampling, eos_token_ids), stream
        )
        finished = False
        try:
            while True:
                output = await outputs.get()
                yield output
                if output.finish_reason is not None:
                    finished = True
                    return
        finally:
            if not finished:  # client went away: free the pages now
                self.call(lambda: self.abort(request_id))

    def abort(self, request_id: str) -> None:
        """Engine thread only."""
        self.streams.pop(request_id, None)
        self.engine.abort(request_id)

    def fail(self, request_id: str, message: str) -> None:
        """Engine thread only: end a request with an error its client will see."""
        stream = self.streams.get(request_id)
        self.engine.abort(request_id)
        if stream is not None:
            self._emit(request_id, stream, None, "error", error=message)

    # ---- health -------------------------------------------------------------------------
    def unhealthy_reason(self) -> str | None:
        """Why this instance is out of service (None: it serves); any thread."""
        thread = self._thread
        if thread.ident is not None and not thread.is_alive() and not self._stopping.is_set():
            self.health.fail("the engine thread stopped")
        return self.health.check()

    def check_health_or_refuse(self) -> None:
        if (reason := self.unhealthy_reason()) is not None:
            raise ServiceUnavailable(f"this instance is out of service: {reason}")

    async def watch(self, interval_s: float = 1.0) -> None:
        """Event loop: look for a stalled or dead engine thread; once out of service, end
        the direct clients' requests here (that thread cannot) and stop looking."""
        timeout = self.health.stall_timeout_s
        interval_s = min(interval_s, timeout / 4) if timeout else interval_s
        while (reason := self.unhealthy_reason()) is None:
            await asyncio.sleep(interval_s)
        self._fail_direct(reason)

    def _fail_direct(self, reason: str) -> None:
        """Event loop: an error for every request a client of this instance waits on (the
        router re-routes its own); the engine thread, should it come back, drops them all."""
        loop = asyncio.get_running_loop()
        message = out_of_service_message(reason)
        for request_id, stream in list(self.streams.items()):
            if stream.routing is None and stream.loop is loop and not stream.finished:
                error = RequestOutput(
                    request_id, "", [], stream.num_prompt_tokens, 0, "error", message
                )
                self._publish([(stream, error)])

    def _out_of_service(self) -> None:
        """Engine thread, once the instance is out of service: end every request here. Its
        direct clients get the reason; requests a router owns are dropped silently (the
        router re-routes them when the heartbeat says so, resuming from the tokens sent)."""
        message = out_of_service_message(self.health.check() or "unknown")
        for request_id, stream in list(self.streams.items()):
            if stream.routing is None:
                self.fail(request_id, message)
            else:
                self.abort(request_id)
        scheduler = self.engine.scheduler
        for request in [*scheduler.waiting, *scheduler.running]:
            self.engine.abort(request.request_id)

    def _loop(self) -> None:
        idle = True
        while not self._stopping.is_set():
            try:
                idle = self._iterate(idle)
            finally:
                self._flush()

    def _iterate(self, idle: bool) -> bool:
        """Run the inbox, then one step if there is work; True when nothing could run."""
        # Sleep while nothing can run: requests waiting for pages, pulls in flight or
        # no requests at all. Everything that can change that (new work, a landed pull,
        # a release that frees pages) arrives through the inbox and wakes us.
        block = idle or not self.engine.has_work()
        health = self.health
        if block:
            health.sleeping()
        try:
            while True:
                work = self._inbox.get(block=block, timeout=IDLE_WAKE_S if block else None)
                health.working()
                block = False
                work()
        except queue.Empty:
            pass
        except Exception:
            log.exception("engine inbox task failed")
        self._flush()  # what the inbox's tasks emitted (a failed request) goes out now
        idle = True
        if not health.ok:  # a stall was found meanwhile: this thread's work is over
            self._out_of_service()
            return idle
        if not self.engine.has_work():
            return idle
        health.working()
        try:
            events, stats = self.engine.step()
        except Exception:  # a bug must not hang clients: fail everything in flight
            if not health.ok:  # a sticky device error: every later step fails alike
                log.exception("device error: this instance is out of service")
                self._out_of_service()
                return idle
            log.exception("engine step failed")
            for request_id in list(self.streams):
                self.fail(request_id, "internal engine error")
            # and those nobody listens to, or the next step fails the same way forever
            scheduler = self.engine.scheduler
            for request in [*scheduler.waiting, *scheduler.running]:
                self.engine.abort(request.request_id)
            return idle
        stepped = time.monotonic()
        idle = stats.idle
        self.num_steps += 1
        for request_id, message in stats.failed.items():
            self.fail(request_id, message)
        for timing in stats.stage_timings:
            if (stream := self.streams.get(timing.request_id)) is not None:
                stream.pending_timings.append(timing)
        # what follows is per request: one that raises fails alone, never the thread
        for event in events:
            self._isolated(event.request_id, self._deliver, event)
        for request_id in stats.evicted_ids:
            self._isolated(request_id, self._evicted, request_id)
        self._flush()  # a request's outputs reach its loop before its hand-off
        for request in self.engine.take_handoffs():
            self._isolated(request.request_id, self._send_on, request)
        for task in stats.pulls:
            if self.on_pull is not None:
                self._isolated(task.request_id, self.on_pull, task)
        if self._on_step is not None and not idle:
            stats.add_phase(PUBLISH, time.monotonic() - stepped)
            self._on_step(stats)
        return idle

    def _isolated(self, request_id: str, fn: Callable[[T], None], arg: T) -> None:
        """Engine thread: ``fn(arg)`` for one request; if it raises, that request fails (a
        detokenizer or hand-off error once escaped and stopped the engine thread for all)."""
        try:
            fn(arg)
        except Exception:
            log.exception("handling request %s after the step failed", request_id)
            try:
                self.fail(request_id, REQUEST_FAILED)
            except Exception:  # its state is beyond repair: at least forget it
                log.exception("could not fail request %s", request_id)
                self.streams.pop(request_id, None)

    def _send_on(self, request: Request) -> None:
        """Engine thread: a request this instance hands to the next stage; its loop gets
        what it emitted before the hand-off itself."""
        stream = self.streams.pop(request.request_id, None)
        if stream is not None and self.on_handoff is not None:
            stream.num_cached_tokens = request.num_cached_tokens
            self._flush_timings(request.request_id, stream)
            self._flush()
            stream.loop.call_soon_threadsafe(self._hand_off, request, stream)
        else:  # nobody to hand it to (no router link): end it clearly
            self.engine.release_migrated(request.request_id)

    def _evicted(self, request_id: str) -> None:
        """Out of pages where it cannot be recomputed: re-route it, or fail it clearly."""
        stream = self.streams.get(request_id)
        if stream is None:
            return
        if stream.routing is not None and self.on_evicted is not None:
            self.streams.pop(request_id, None)
            self.engine.abort(request_id)
            self._flush()  # its outputs so far first
            stream.loop.call_soon_threadsafe(self.on_evicted, stream)
        else:
            self.fail(request_id, "out of KV cache pages on a decode-only instance")

    def _deliver(self, event: RequestEvent) -> None:
        request_id, token_id, finish_reason = (
            event.request_id,
            event.new_token_id,
            event.finish_reason,
        )
        stream = self.streams.get(request_id)
        if stream is None:
            return
        logprobs = [event.logprobs] if event.logprobs is not None else []
        stream.num_cached_tokens = max(stream.num_cached_tokens, event.num_cached_tokens)
        self._emit(request_id, stream, token_id, finish_reason, logprobs=logprobs)

    def _emit(
        self,
        request_id: str,
        stream: RequestOutputStream,
        token_id: int | None,
        finish_reason: str | None,
        error: str | None = None,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> None:
        """Queue an output for the loop, which adds its text and token count (``_publish``)."""
        if (request := self.engine.scheduler.requests.get(request_id)) is not None:
            stream.num_cached_tokens = max(stream.num_cached_tokens, request.num_cached_tokens)
        output = RequestOutput(
            request_id,
            "",
            [token_id] if token_id is not None else [],
            stream.num_prompt_tokens,
            0,
            finish_reason,
            error,
            stream.pending_timings,
            logprobs or [],
            stream.num_cached_tokens,
        )
        stream.pending_timings = []
        if finish_reason is not None:
            self.streams.pop(request_id, None)
        self._outbox.setdefault(stream.loop, []).append((stream, output))

    def _flush(self) -> None:
        """Hand the outputs gathered so far to their event loops: one call per loop."""
        outbox, self._outbox = self._outbox, {}
        for loop, outputs in outbox.items():
            loop.call_soon_threadsafe(self._publish, outputs)

    # ---- event loop -------------------------------------------------------------------
    def _publish(self, outputs: list[tuple[RequestOutputStream, RequestOutput]]) -> None:
        """Detokenize each output's tokens, then hand it to its sink, in order (one failing
        sink spoils no other)."""
        now = time.monotonic()
        for stream, output in outputs:
            output.published_s = now
            if stream.finished:
                continue  # a stop string ended it; the engine made a token more meanwhile
            try:
                self._detokenize(stream, output)
            except Exception:  # this request's output cannot be read: it fails, alone
                log.exception("detokenizing the output of %s failed", output.request_id)
                output = replace(
                    output, text_delta="", new_token_ids=[], logprobs=[],
                    finish_reason="error", error=REQUEST_FAILED,
                )  # fmt: skip
                self.call(functools.partial(self._abandon, output.request_id, stream))
            stream.finished = output.finish_reason is not None
            try:
                stream.sink(output)
            except Exception:
                log.exception("output of %s failed", output.request_id)

    def _detokenize(self, stream: RequestOutputStream, output: RequestOutput) -> None:
        final = output.finish_reason is not None
        for token_id in output.new_token_ids:
            stream.num_output_tokens += 1
            output.text_delta += stream.detokenizer.add(token_id, final=final)
            if stream.detokenizer.stopped and output.finish_reason is None:
                output.finish_reason = "stop"
                self.call(functools.partial(self._stopped, output.request_id, stream))
                break
        output.num_output_tokens = stream.num_output_tokens

    def _hand_off(self, request: Request, stream: RequestOutputStream) -> None:
        if stream.finished:  # a stop string in its last text ended it: nothing to hand on
            self.call(lambda: self.engine.release_migrated(request.request_id))
        elif self.on_handoff is not None:
            self.on_handoff(request, stream)

    def _abandon(self, request_id: str, stream: RequestOutputStream) -> None:
        """Engine thread: the loop ended the request with an error; free its pages."""
        if self.streams.get(request_id) is stream:
            self.streams.pop(request_id)
            self.engine.abort(request_id)

    def _stopped(self, request_id: str, stream: RequestOutputStream) -> None:
        """Engine thread: the loop found a stop string; end the request, free its pages."""
        if self.streams.get(request_id) is stream:
            self.streams.pop(request_id)
            self.engine.finish_stopped(request_id)

    def _flush_timings(self, request_id: str, stream: RequestOutputStream) -> None:
        """What the router has not heard of a request handed on: its stage timings and the
        prompt tokens its cache served."""
        if stream.pending_timings or stream.num_cached_tokens:
            self._emit(request_id, stream, None, None)


def out_of_service_message(reason: str) -> str:
    """What a client whose request this instance cannot finish is told."""
    return f"this instance is out of service ({reason}); retry the request"


def _set_result(future: asyncio.Future[object], value: object) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[object], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
