"""What migration needs from the engine and from the router link (DESIGN.md §4).

The two sides of a migration (``source.py``, ``target.py``) reach the engine only through
``EngineHooks``: expose a parked request's pages, admit a pulled-in request, land its pages,
free or abort a request, recompute one whose pull failed. ``AsyncEngineHooks`` is the one
implementation, over the engine-thread bridge (``engine/async_engine.py``): the only code in
``disagg/`` that knows the engine core's names. The engine calls back into migration through
``SourceEvents`` and ``TargetEvents``, connected once (``EngineHooks.connect``).

``RouterPort`` is what migration uses of the instance's router link (``router_link.py``),
which the app owns: the peer table, this instance's identity, events and re-routes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol, cast

from epd_engine.contracts.routing_policy import InstanceLoad
from epd_engine.disagg.early_handoff import DeviceEvent, record_layer_event
from epd_engine.engine.async_engine import AsyncEngine, RequestOutput, RequestOutputStream
from epd_engine.engine.detokenizer import Detokenizer
from epd_engine.model.llava import LayerWritten
from epd_engine.request import CacheKind, Request
from epd_engine.scheduler.output import PullTask, TokenTask
from epd_engine.transfer.backend import PageTransfer
from epd_engine.transfer.messages import PrefillDone, Routing

# A parked request's pages: per image (in prompt order), and the KV pages of its tokens.
ExposedPages = tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]


class SourceEvents(Protocol):
    """The engine's calls into the source side."""

    def on_handoff(self, request: Request, stream: RequestOutputStream) -> None:
        """Event loop: ``request`` is parked here and its next stage lives elsewhere."""
        ...

    def watch_prefill(self, started: list[tuple[Request, TokenTask]]) -> LayerWritten | None:
        """Engine thread: prefill chunks about to run; returns what to call after each
        layer has written them (or None), so KV can move while prefill runs."""
        ...

    def on_forget(self, request_id: str) -> None:
        """Engine thread: a request left the engine (finished, aborted or released)."""
        ...


class TargetEvents(Protocol):
    """The engine's calls into the target side."""

    def on_pull(self, task: PullTask) -> None:
        """Engine thread: pages were allocated for a migrated-in request; fill them."""
        ...

    def on_evicted(self, stream: RequestOutputStream) -> None:
        """Event loop: a request ran out of pages where it cannot be recomputed."""
        ...


class EngineHooks(Protocol):
    """What migration needs from one instance's engine. Methods not marked otherwise are
    called on the event loop; the engine's own state changes on its thread."""

    @property
    def num_layers(self) -> int: ...

    @property
    def kv_block_size(self) -> int: ...

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: global); empty when every layer is global."""
        ...

    def decode(self, token_ids: list[int]) -> str:
        """Token ids to text (a migrated-in request's detokenizer resumes with it)."""
        ...

    def stream(self, request_id: str) -> RequestOutputStream | None:
        """Where a request's outputs go (either thread), None once it left the engine."""
        ...

    async def exposed_pages(self, request_id: str) -> ExposedPages:
        """Step 1 on the source: a parked request's pages, read on the engine thread."""
        ...

    def free(self, request_id: str) -> None:
        """Step 4 on the source: drop a parked request and free its pages (queued)."""
        ...

    def abort(self, request_id: str) -> None:
        """End a request here and free its pages, without an output (queued)."""
        ...

    async def admit(self, request: Request, stream: RequestOutputStream) -> None:
        """Step 1 on the target: queue a migrated-in request (its ``pull`` says from
        where); the scheduler allocates its pages and emits a ``PullTask``. Raises
        ``ClientError`` when the engine cannot take it."""
        ...

    async def land(self, request_id: str, done: PrefillDone | None) -> None:
        """Step 3 ended on the target: the pulled pages are filled, the request runs here.
        ``done``: how the source's prefill ended for an early offer (its outputs resume
        from the token it sampled and the text the client has)."""
        ...

    async def recompute(self, request_id: str) -> bool:
        """A pull failed: True when the request is recomputed here instead (re-encode or
        re-prefill); False when this instance cannot (it must go elsewhere)."""
        ...

    def stage_pull(self, transfer: PageTransfer) -> PageTransfer:
        """Where a pull lands first: on a tensor-parallel instance, KV goes into whole-head
        staging pages (``parallel/kv_staging.py``; ``TransferError`` when none are free);
        elsewhere ``transfer`` itself."""
        ...

    async def land_pull(self, transfer: PageTransfer, staged: PageTransfer) -> None:
        """A pull landed in ``staged`` (``stage_pull``): copy its pages out to every rank's
        heads of ``transfer``'s (nothing when they are the same)."""
        ...

    def release_pull(self, request_id: str) -> None:
        """The request's staging pages on this target are no longer needed."""
        ...

    def layer_event(self) -> DeviceEvent | None:
        """Engine thread, after a layer's kernels are queued: an event that completes when
        they do; None where a layer is written when its call returns (a CPU)."""
        ...

    def connect(self, source: SourceEvents, target: TargetEvents) -> None:
        """Route the engine's migration events to the two sides (once, before it starts)."""
        ...


class RouterPort(Protocol):
    """What migration uses of the router link: the router's table of instances (from its
    heartbeats), this instance's identity, ordered events and re-routes."""

    @property
    def identity(self) -> InstanceLoad: ...

    @property
    def instances(self) -> Sequence[InstanceLoad]:
        """The active instances, as of the last heartbeat answer (empty: none yet)."""
        ...

    @property
    def heartbeat_s(self) -> float: ...

    def send(self, output: RequestOutput, routing: Routing) -> None:
        """Queue one output of a request this instance holds (event loop)."""
        ...

    def send_raw(self, event: dict[str, object]) -> None:
        """Queue one event in the same ordered stream (event loop)."""
        ...

    async def retry(self, routing: Routing, reason: str) -> None:
        """Ask the router to send the request down a fresh path."""
        ...


class AsyncEngineHooks:
    """``EngineHooks`` over ``AsyncEngine``: engine-core calls cross into its thread."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    @property
    def num_layers(self) -> int:
        return self._engine.engine.num_layers

    @property
    def kv_block_size(self) -> int:
        return self._engine.engine.config.kv_block_size

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return tuple(getattr(self._engine.engine.model_config, "layer_windows", ()))

    def decode(self, token_ids: list[int]) -> str:
        return self._engine.decode(token_ids)

    def stream(self, request_id: str) -> RequestOutputStream | None:
        return self._engine.streams.get(request_id)

    async def exposed_pages(self, request_id: str) -> ExposedPages:
        core = self._engine.engine
        return cast(
            ExposedPages, await self._engine.call_async(lambda: core.exposed_pages(request_id))
        )

    def free(self, request_id: str) -> None:
        core = self._engine.engine
        self._engine.call(lambda: core.release_migrated(request_id))

    def abort(self, request_id: str) -> None:
        self._engine.call(lambda: self._engine.abort(request_id))

    async def admit(self, request: Request, stream: RequestOutputStream) -> None:
        core = self._engine.engine
        await self._engine.add(lambda: core.add(request), stream)

    async def land(self, request_id: str, done: PrefillDone | None) -> None:
        await self._engine.call_async(lambda: self._land(request_id, done))

    def stage_pull(self, transfer: PageTransfer) -> PageTransfer:
        staging = self._engine.engine.runner.staging
        if staging is None or transfer.kind is not CacheKind.KV:
            return transfer
        staged = staging.stage(transfer.request_id, transfer.dst_pages)
        return replace(transfer, dst_pages=staged)

    async def land_pull(self, transfer: PageTransfer, staged: PageTransfer) -> None:
        staging = self._engine.engine.runner.staging
        if staging is None or staged is transfer:
            return
        pages, start, stop = transfer.dst_pages, transfer.layer_start, transfer.layer_stop
        await self._engine.call_async(lambda: staging.scatter(staged.dst_pages, pages, start, stop))

    def release_pull(self, request_id: str) -> None:
        staging = self._engine.engine.runner.staging
        if staging is not None:
            staging.release(request_id)

    def _land(self, request_id: str, done: PrefillDone | None) -> None:
        """Engine thread (no output of the request is on the way): for an early offer, take
        over the request as the source's prefill left it."""
        stream = self._engine.streams.get(request_id)
        if done is not None and stream is not None:
            old = stream.detokenizer
            stream.detokenizer = Detokenizer.resume(
                self._engine.decode, old.stop, done.output_token_ids, done.emitted_text,
                old.min_tokens, old.whole_text_only,
            )  # fmt: skip
            stream.num_output_tokens = len(done.output_token_ids)
        self._engine.engine.pull_done(request_id, done.output_token_ids if done else None)

    async def recompute(self, request_id: str) -> bool:
        core = self._engine.engine
        return bool(await self._engine.call_async(lambda: core.pull_failed(request_id)))

    def layer_event(self) -> DeviceEvent | None:
        return record_layer_event(self._engine.engine.runner.device)

    def connect(self, source: SourceEvents, target: TargetEvents) -> None:
        engine = self._engine
        engine.on_handoff = source.on_handoff
        engine.on_pull = target.on_pull
        engine.on_evicted = target.on_evicted
        engine.engine.watch_prefill = source.watch_prefill
        engine.engine.on_forget = source.on_forget
