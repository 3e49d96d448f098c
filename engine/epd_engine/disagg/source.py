"""The source side of a pull-based migration (DESIGN.md §4, steps 1, 3 and 4).

When a request's next stage lives elsewhere the engine parks it and hands it here: expose
its pages to the transfer backend, offer it to the least-loaded instance of that stage that
takes it (step 1, ``peers.py``); the backend serves the pages to the target's pull (3); free
them when the target releases them (4). A hand-off that nobody takes, or that fails, goes
back to the router: the request is never lost.

KV is offered early, when prefill starts, and each layer is published as it is written
(``early_handoff.py``); the plain hand-off after prefill remains for image caches, for
requests no target took early and with ``early_kv=False``.
"""

from __future__ import annotations

import asyncio
import logging
import time

from epd_engine.config import Stage, env_str
from epd_engine.contracts.routing_policy import InstanceLoad
from epd_engine.disagg.background import Background
from epd_engine.disagg.early_handoff import (
    ENDED_KEPT_S,
    PrefillWatch,
    publish_layer,
    publish_layer_when_done,
)
from epd_engine.disagg.hooks import EngineHooks, RouterPort
from epd_engine.disagg.peers import Peers
from epd_engine.engine.async_engine import RequestOutputStream
from epd_engine.model.llava import LayerWritten
from epd_engine.request import CacheKind, Request
from epd_engine.scheduler.output import TokenTask
from epd_engine.transfer.backend import Exports, TransferBackend
from epd_engine.transfer.messages import (
    ImageInfo,
    MigrationOffer,
    PrefillDone,
    PrefillProgress,
    SamplingInfo,
)

log = logging.getLogger(__name__)


class Source:
    def __init__(
        self,
        hooks: EngineHooks,
        link: RouterPort,
        peers: Peers,
        backend: TransferBackend,
        exports: Exports,
        background: Background,
        early_kv: bool = True,
    ) -> None:
        self.hooks = hooks
        self.link = link
        self.peers = peers
        self.backend = backend
        self.exports = exports
        self.background = background
        self.early_kv = early_kv
        self.handed_to: dict[str, InstanceLoad] = {}  # parked request -> who took its offer
        self.watches: dict[str, PrefillWatch] = {}  # offered early, by request id
        self.loop = asyncio.get_running_loop()
        # fault injection for tests: make each layer of a prefill whose KV migrates slower
        self.layer_delay_s = float(env_str("FAULT_LAYER_DELAY_S", "0"))

    # ---- hand-off after the stage ends ------------------------------------------------
    def on_handoff(self, request: Request, stream: RequestOutputStream) -> None:
        self.background.spawn(self._handoff_or_reroute(request, stream))

    async def _handoff_or_reroute(self, request: Request, stream: RequestOutputStream) -> None:
        try:
            await self._handoff(request, stream)
        except Exception as exc:  # never leave a parked request without an owner
            log.exception("handoff of %s failed", request.request_id)
            self.release(request.request_id)
            assert stream.routing is not None
            await self.link.retry(stream.routing, f"handoff failed: {exc!r}")

    async def _handoff(self, request: Request, stream: RequestOutputStream) -> None:
        assert stream.routing is not None
        if request.request_id in self.watches and await self._finish_early(request, stream):
            return
        kind = CacheKind.IMAGE if request.next_stage is Stage.PREFILL else CacheKind.KV
        image_pages, kv_pages = await self.hooks.exposed_pages(request.request_id)
        pages = kv_pages if kind is CacheKind.KV else [p for ps in image_pages for p in ps]
        self.exports.expose(request.request_id, kind, pages)
        offer = self._offer(request, stream, kind, image_pages, kv_pages)
        target = await self.peers.place(offer, request.next_stage)
        if target is not None:
            self.handed_to[request.request_id] = target
            return
        log.error("no %s instance took %s", request.next_stage.value, request.request_id)
        self.release(request.request_id)
        await self.link.retry(stream.routing, f"no instance for {request.next_stage.value}")

    def _offer(
        self,
        request: Request,
        stream: RequestOutputStream,
        kind: CacheKind,
        image_pages: tuple[tuple[int, ...], ...],
        kv_pages: tuple[int, ...],
        early: bool = False,
    ) -> MigrationOffer:
        """``early``: offered as prefill starts, with the tokens prefill will compute."""
        p = request.sampling
        assert stream.routing is not None
        routing = stream.routing.model_copy(
            update={"path": [*stream.routing.path, self.link.identity.pool]}
        )
        return MigrationOffer(
            request_id=request.request_id,
            kind=kind,
            source_url=self.link.identity.url,
            source_instance=self.link.identity.instance_id,
            prompt_token_ids=request.prompt_token_ids,
            images=[ImageInfo(**vars(i)) for i in request.images],
            sampling=SamplingInfo.of(p),
            eos_token_ids=sorted(request.eos_token_ids),
            output_token_ids=request.output_token_ids,
            num_computed_tokens=request.num_tokens if early else request.num_computed_tokens,
            image_pages=[list(ps) for ps in image_pages],
            kv_pages=list(kv_pages) if kind is CacheKind.KV else [],
            transfer=self.backend.describe(),
            emitted_text=stream.detokenizer.emitted,
            routing=routing,
            early=early,
        )

    def release(self, request_id: str) -> None:
        """Step 4 on the source (also after a failed hand-off): stop serving, free pages."""
        watch = self.watches.pop(request_id, None)
        self.exports.withdraw(request_id)
        self.handed_to.pop(request_id, None)
        if watch is not None and watch.done is None and not watch.ended:
            # The target of an early offer gave up while we still prefill (its pull failed
            # and it asked the router to re-route): this copy has no future.
            self.hooks.abort(request_id)
            return
        self.hooks.free(request_id)

    # ---- early hand-off ---------------------------------------------------------------
    def watch_prefill(self, started: list[tuple[Request, TokenTask]]) -> LayerWritten | None:
        """Engine thread: prefill chunks about to run whose KV goes to a decode instance.
        Offer each request as its first chunk starts; publish every layer as it is written."""
        watches = []
        for request, task in started:
            watch = self.watches.get(request.request_id) or self._start_watch(request, task)
            if watch is None or watch.ended:
                continue
            watch.pages = tuple(task.block_table)
            watch.chunk_end = task.start_position + task.num_tokens
            self.exports.expose(request.request_id, CacheKind.KV, watch.pages)
            watches.append(watch)
        if not watches:
            return None

        def layer_written(layer: int) -> None:
            ends = [(watch, watch.chunk_end) for watch in watches]
            event = self.hooks.layer_event()
            if event is None:  # CPU: the layer is written now
                publish_layer(layer, ends)
                self.loop.call_soon_threadsafe(_changed, watches)
            else:  # GPU: once its kernels are done
                publish = publish_layer_when_done(event, layer, ends)
                self.loop.call_soon_threadsafe(self.background.spawn, publish)
            if self.layer_delay_s:
                time.sleep(self.layer_delay_s)

        return layer_written

    def _start_watch(self, request: Request, task: TokenTask) -> PrefillWatch | None:
        stream = self.hooks.stream(request.request_id)
        # its first chunk: prefill starts after what the prefix cache held
        first_chunk = task.start_position == request.num_prefix_hit_tokens
        if not self.early_kv or not first_chunk or stream is None:
            return None
        if stream.routing is None:
            return None
        watch = PrefillWatch(request.request_id, self.hooks.num_layers, self.loop)
        offer = self._offer(request, stream, CacheKind.KV, (), (), early=True)
        self.watches[request.request_id] = watch
        self.loop.call_soon_threadsafe(
            lambda: self.background.spawn(self._offer_early(watch, offer))
        )
        return watch

    async def _offer_early(self, watch: PrefillWatch, offer: MigrationOffer) -> None:
        target = None
        try:
            target = await self.peers.place(offer, Stage.DECODE)
            if target is not None and self.watches.get(watch.request_id) is watch:
                self.handed_to[watch.request_id] = target
        finally:
            watch.target.set_result(target)

    async def _finish_early(self, request: Request, stream: RequestOutputStream) -> bool:
        """Prefill ended on a request offered early: tell its target how it ended (the
        answer to its progress poll). False when no target took it: offer it as usual."""
        watch = self.watches[request.request_id]
        target = await watch.target
        if target is None or self.watches.get(request.request_id) is not watch:
            self.watches.pop(request.request_id, None)
            return False
        _, kv_pages = await self.hooks.exposed_pages(request.request_id)
        self.exports.expose(request.request_id, CacheKind.KV, kv_pages)
        watch.pages = kv_pages
        watch.done = PrefillDone(
            num_computed_tokens=request.num_computed_tokens,
            output_token_ids=list(request.output_token_ids),
            emitted_text=stream.detokenizer.emitted,
        )
        watch.changed()
        # The request is the target's from here (the router re-routes it if the target
        # dies); the target itself speaks up only once its pull has landed.
        assert stream.routing is not None
        self.link.send_raw(
            {
                "router_request_id": stream.routing.router_request_id,
                "attempt": stream.routing.attempt,
                "instance_id": target.instance_id,
                "pool": target.pool,
            }
        )
        return True

    def on_forget(self, request_id: str) -> None:
        """Engine thread: a request left the engine. One still prefilling under an early
        offer has ended here (finished at its first token, or aborted): tell its target."""
        watch = self.watches.get(request_id)
        if watch is None or watch.done is not None:
            return
        watch.ended = True
        self.exports.withdraw(request_id)
        self.loop.call_soon_threadsafe(self._end_watch, watch)

    def _end_watch(self, watch: PrefillWatch) -> None:
        watch.changed()
        self.handed_to.pop(watch.request_id, None)

        def forget() -> None:
            if self.watches.get(watch.request_id) is watch:
                del self.watches[watch.request_id]

        self.loop.call_later(ENDED_KEPT_S, forget)

    async def progress(self, request_id: str, after: int) -> PrefillProgress | None:
        """A target's long-poll on a request offered early (None: unknown here)."""
        watch = self.watches.get(request_id)
        return None if watch is None else await watch.newer_than(after)

    # ---- targets that die -------------------------------------------------------------
    async def check_targets(self, alive: set[str]) -> None:
        """Free what we parked for a target that left the router's table and does not answer
        (the router re-routes that request; nobody will pull these pages). One that answers
        is alive in a draining pool, which still pulls."""
        for request_id, target in list(self.handed_to.items()):
            if target.instance_id not in alive and not await self.peers.answers(target):
                log.warning("%s died before pulling %s", target.instance_id, request_id)
                self._target_lost(request_id)

    def _target_lost(self, request_id: str) -> None:
        """The target of a hand-off died before pulling. Still prefilling here: offer it
        again when prefill ends; already parked: free it (the router re-routes it)."""
        watch = self.watches.pop(request_id, None)
        if watch is not None and watch.done is None:
            self.handed_to.pop(request_id, None)
            return
        self.release(request_id)


def _changed(watches: list[PrefillWatch]) -> None:
    for watch in watches:
        watch.changed()
