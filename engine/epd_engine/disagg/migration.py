"""Both sides of pull-based migration on one instance (DESIGN.md §4).

Source: when a request's next stage lives elsewhere, expose its pages and offer it to the
least-loaded instance of that stage (step 1); its transfer backend serves the pages (3);
free them on release (4). Target: queue the offer; when the scheduler has pages it emits a
PullTask; the backend copies the source's pages straight into ours (KV in layer groups),
then the request runs here and the source is released. If the pull fails, recompute here
when the role allows, otherwise ask the router to re-route: the request is never lost.

KV is offered early, when prefill starts, and moves in layer groups while prefill runs
(``early_handoff.py``); the plain hand-off after prefill remains for image caches, for
requests no target took early and with ``early_kv=False``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import cast

import httpx

from epd_engine.config import Stage, env_str
from epd_engine.contracts.routing_policy import InstanceLoad, LeastLoaded
from epd_engine.disagg.early_handoff import (
    ENDED_KEPT_S,
    DeviceEvent,
    PrefillWatch,
    SourceEnded,
    layer_groups,
    publish_layer,
    publish_layer_when_done,
    pull_groups,
    record_layer_event,
)
from epd_engine.disagg.router_link import RouterLink
from epd_engine.engine.async_engine import AsyncEngine, RequestOutput, RequestOutputStream
from epd_engine.engine.detokenizer import Detokenizer
from epd_engine.metrics import Metrics
from epd_engine.model.llava import LayerWritten
from epd_engine.request import CacheKind, ImageRef, PullSpec, Request
from epd_engine.scheduler.output import PullTask, TokenTask
from epd_engine.transfer.backend import Exports, PageTransfer, Peer, TransferBackend, TransferError
from epd_engine.transfer.messages import (
    ImageInfo,
    MigrationOffer,
    PrefillDone,
    PrefillProgress,
    SamplingInfo,
)
from epd_engine.transfer.plan import transfers_for

log = logging.getLogger(__name__)
# How long a source waits for a peer of the next stage to appear in its table before it
# hands the request back to the router (longer than the router's 3 s instance timeout).
TARGET_WAIT_S = 5.0


class MigrationManager:
    def __init__(
        self,
        engine: AsyncEngine,
        link: RouterLink,
        backend: TransferBackend,
        exports: Exports,
        http: httpx.AsyncClient,
        token: str,
        layers_per_group: int = 8,
        early_kv: bool = True,
        metrics: Metrics | None = None,
    ) -> None:
        self.engine = engine
        self.link = link
        self.backend = backend
        self.exports = exports
        self.peers: set[str] = set()  # sources we pulled from (the backend holds connections)
        self.handed_to: dict[str, InstanceLoad] = {}  # parked request -> who took its offer
        self.http = http
        self.headers = {"X-EPD-Token": token}
        self.layers_per_group = layers_per_group
        self.early_kv = early_kv
        self.metrics = metrics
        self.watches: dict[str, PrefillWatch] = {}  # offered early, by request id
        self.policy = LeastLoaded()
        self.loop = asyncio.get_running_loop()
        # fault injection for tests: hold each pull this long, so a test can kill the source
        self.pull_delay_s = float(env_str("FAULT_PULL_DELAY_S", "0"))
        # ... and make each layer of a prefill whose KV migrates this much slower
        self.layer_delay_s = float(env_str("FAULT_LAYER_DELAY_S", "0"))
        self._tasks: set[asyncio.Task[None]] = set()
        # engine thread, after a layer's kernels are queued (a test may stand one in)
        self.record_layer_event: Callable[[], DeviceEvent | None] = lambda: record_layer_event(
            self.engine.engine.runner.device
        )
        engine.on_handoff = self.on_handoff
        engine.on_pull = self.on_pull
        engine.on_evicted = self.on_evicted
        engine.engine.watch_prefill = self.watch_prefill
        engine.engine.on_forget = self.on_forget
        self._spawn(self._watch_peers())

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.backend.close()

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- source side ------------------------------------------------------------------
    def on_handoff(self, request: Request, stream: RequestOutputStream) -> None:
        self._spawn(self._handoff_or_reroute(request, stream))

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
        image_pages, kv_pages = await self._exposed_pages(request.request_id)
        pages = kv_pages if kind is CacheKind.KV else [p for ps in image_pages for p in ps]
        self.exports.expose(request.request_id, kind, pages)
        offer = self._offer(request, stream, kind, image_pages, kv_pages)
        target = await self._place(offer, request.next_stage)
        if target is not None:
            self.handed_to[request.request_id] = target
            return
        log.error("no %s instance took %s", request.next_stage.value, request.request_id)
        self.release(request.request_id)
        await self.link.retry(stream.routing, f"no instance for {request.next_stage.value}")

    async def _exposed_pages(
        self, request_id: str
    ) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
        """A parked request's image pages (per image) and KV pages, read on the engine thread."""
        exposed = await self.engine.call_async(lambda: self.engine.engine.exposed_pages(request_id))
        return cast(tuple[tuple[tuple[int, ...], ...], tuple[int, ...]], exposed)

    async def _place(self, offer: MigrationOffer, stage: Stage) -> InstanceLoad | None:
        """Offer to the least-loaded instance of ``stage`` that takes it; None if none does."""
        candidates = await self._targets(stage)
        while candidates:
            target = self.policy.choose(candidates)
            candidates.remove(target)
            if await self._send_offer(target, offer):
                return target
        return None

    async def _targets(self, stage: Stage) -> list[InstanceLoad]:
        """Peers that run ``stage``. An empty table waits a little: an instance learns of its
        peers from heartbeat answers, so one that just started may not know them yet."""
        deadline = time.monotonic() + TARGET_WAIT_S
        while True:
            me = self.link.identity.instance_id
            found = [i for i in self.link.instances if i.role.runs(stage) and i.instance_id != me]
            if found or time.monotonic() >= deadline:
                return found
            await asyncio.sleep(self.link.heartbeat_s / 2)

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

    async def _send_offer(self, target: InstanceLoad, offer: MigrationOffer) -> bool:
        try:
            response = await self.http.post(
                f"{target.url}/internal/migrations",
                json=offer.model_dump(mode="json"),
                headers=self.headers,
                timeout=10.0,
            )
        except httpx.HTTPError as exc:
            log.warning("offer of %s to %s failed: %r", offer.request_id, target.url, exc)
            return False
        if response.status_code != 200:
            log.warning("%s refused %s: %s", target.url, offer.request_id, response.text[:200])
        return response.status_code == 200

    def release(self, request_id: str) -> None:
        """Step 4 on the source (also after a failed hand-off): stop serving, free pages."""
        watch = self.watches.pop(request_id, None)
        self.exports.withdraw(request_id)
        self.handed_to.pop(request_id, None)
        if watch is not None and watch.done is None and not watch.ended:
            # The target of an early offer gave up while we still prefill (its pull failed
            # and it asked the router to re-route): this copy has no future.
            self.engine.call(lambda: self.engine.abort(request_id))
            return
        self.engine.call(lambda: self.engine.engine.release_migrated(request_id))

    # ---- source side: early hand-off --------------------------------------------------
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
            event = self.record_layer_event()
            if event is None:  # CPU: the layer is written now
                publish_layer(layer, ends)
                self.loop.call_soon_threadsafe(_changed, watches)
            else:  # GPU: once its kernels are done
                publish = publish_layer_when_done(event, layer, ends)
                self.loop.call_soon_threadsafe(self._spawn, publish)
            if self.layer_delay_s:
                time.sleep(self.layer_delay_s)

        return layer_written

    def _start_watch(self, request: Request, task: TokenTask) -> PrefillWatch | None:
        stream = self.engine.streams.get(request.request_id)
        if not self.early_kv or task.start_position != 0 or stream is None:
            return None
        if stream.routing is None:
            return None
        watch = PrefillWatch(request.request_id, self.engine.engine.num_layers, self.loop)
        offer = self._offer(request, stream, CacheKind.KV, (), (), early=True)
        self.watches[request.request_id] = watch
        self.loop.call_soon_threadsafe(lambda: self._spawn(self._offer_early(watch, offer)))
        return watch

    async def _offer_early(self, watch: PrefillWatch, offer: MigrationOffer) -> None:
        target = None
        try:
            target = await self._place(offer, Stage.DECODE)
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
        _, kv_pages = await self._exposed_pages(request.request_id)
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

    # ---- target side ------------------------------------------------------------------
    async def accept(self, offer: MigrationOffer) -> None:
        """Step 1 on the target: queue the request; it pulls when scheduled."""
        sampling = offer.sampling.params()
        detokenizer = Detokenizer.resume(
            self.engine.decode,
            sampling.stop,
            offer.output_token_ids,
            offer.emitted_text,
            sampling.min_tokens,
            offer.routing.whole_answer,
        )
        routing = offer.routing
        stream = RequestOutputStream(
            sink=lambda output: self.link.send(output, routing),
            loop=self.loop,
            detokenizer=detokenizer,
            num_prompt_tokens=len(offer.prompt_token_ids),
            num_output_tokens=len(offer.output_token_ids),
            routing=routing,
        )
        images = [ImageRef(**i.model_dump()) for i in offer.images]

        def make() -> Request:
            request = Request(
                request_id=offer.request_id,
                prompt_token_ids=offer.prompt_token_ids,
                sampling=sampling,
                images=images,
                eos_token_ids=frozenset(offer.eos_token_ids),
                num_encoded_images=len(images),
                num_computed_tokens=offer.num_computed_tokens if offer.kind is CacheKind.KV else 0,
                output_token_ids=list(offer.output_token_ids),
                pull=PullSpec(
                    offer.kind,
                    offer.source_url,
                    offer.source_instance,
                    offer.transfer,
                    tuple(tuple(ps) for ps in offer.image_pages),
                    tuple(offer.kv_pages),
                    early=offer.early,
                ),
            )
            return self.engine.engine.add(request)

        await self.engine.add(make, stream)
        if not offer.early:  # an early offer is ours once the source's prefill has ended
            self._announce(offer.request_id, stream)

    def _announce(self, request_id: str, stream: RequestOutputStream) -> None:
        """Tell the router we hold the request now (it re-routes it if we die)."""
        assert stream.routing is not None
        output = RequestOutput(
            request_id, "", [], stream.num_prompt_tokens, stream.num_output_tokens
        )
        self.link.send(output, stream.routing)

    def on_evicted(self, stream: RequestOutputStream) -> None:
        """This decode-only instance ran out of pages for it: send it down a fresh path."""
        assert stream.routing is not None
        self._spawn(self.link.retry(stream.routing, "evicted: out of KV cache pages"))

    def on_pull(self, task: PullTask) -> None:
        """Engine thread: a PullTask was scheduled; do the I/O on the event loop."""
        issued_s = time.monotonic()
        self.loop.call_soon_threadsafe(lambda: self._spawn(self._pull(task, issued_s)))

    async def _pull(self, task: PullTask, issued_s: float) -> None:
        """The migration's time runs from the pull's scheduling to the bytes being in our
        pages; the wait for the engine's next iteration after that is queueing (it is in
        the stage's queue time, and the simulator models it as such)."""
        if self.pull_delay_s:
            await asyncio.sleep(self.pull_delay_s)
        source = task.source
        peer = Peer(source.source_instance, source.source_url, source.descriptor)
        engine = self.engine.engine
        done: PrefillDone | None = None
        try:
            self.peers.add(peer.instance_id)
            if source.early:
                done, issued_s = await self._pull_early(task, peer)
            else:
                transfers = transfers_for(
                    task, engine.num_layers, self.layers_per_group, engine.config.kv_block_size
                )
                for transfer in transfers:  # each lands in our pages as it completes
                    await self.backend.pull(peer, transfer)
                self._count_groups(task, len(transfers), 0)
        except SourceEnded:  # finished at its first token, or aborted: nothing to go on with
            self.engine.call(lambda: self.engine.abort(task.request_id))
            return
        except Exception as exc:  # TransferError or a broken peer: never hang
            log.warning("pull of %s from %s failed: %r", task.request_id, peer.instance_id, exc)
            await self._pull_failed(task, str(exc))
            return

        seconds = time.monotonic() - issued_s
        # Read before landing: once landed, the engine may finish its stage and hand the
        # request on (dropping the stream) before this coroutine runs again.
        stream = self.engine.streams.get(task.request_id)
        await self.engine.call_async(lambda: self._land(task.request_id, done))
        if done is not None and stream is not None:
            self._announce(task.request_id, stream)
        if stream is not None and stream.routing is not None:
            self.link.send_raw(
                {
                    "router_request_id": stream.routing.router_request_id,
                    "attempt": stream.routing.attempt,
                    "instance_id": self.link.identity.instance_id,
                    "pool": self.link.identity.pool,
                    "migration": {"kind": task.kind.value, "seconds": seconds},
                }
            )
        await self._release_source(task)

    async def _pull_early(self, task: PullTask, peer: Peer) -> tuple[PrefillDone, float]:
        """Pull each layer group as the source writes it; the migration's time runs from
        the end of the source's prefill (what is left of it on the request's path)."""
        groups = layer_groups(self.engine.engine.num_layers, self.layers_per_group)

        async def poll(version: int) -> PrefillProgress:
            return await self._poll_progress(task, version)

        async def pull(transfer: PageTransfer) -> None:
            await self.backend.pull(peer, transfer)

        block_size = self.engine.engine.config.kv_block_size
        done, done_s, overlapped = await pull_groups(task, groups, block_size, poll, pull)
        self._count_groups(task, len(groups) - overlapped, overlapped)
        return done, done_s

    async def _poll_progress(self, task: PullTask, after: int) -> PrefillProgress:
        url = f"{task.source.source_url}/internal/migrations/{task.request_id}/progress"
        try:
            response = await self.http.get(
                url, params={"after": after}, headers=self.headers, timeout=30.0
            )
        except httpx.HTTPError as exc:
            raise TransferError(f"progress poll failed: {exc!r}") from exc
        if response.status_code == 404:
            raise TransferError(f"the source no longer knows {task.request_id}")
        if response.status_code != 200:
            raise TransferError(f"progress poll: {response.status_code} {response.text[:200]}")
        return PrefillProgress.model_validate(response.json())

    def _land(self, request_id: str, done: PrefillDone | None) -> None:
        """Engine thread: the pages are filled. For an early offer, take over the request as
        the source's prefill left it (the token it sampled, the text the client has)."""
        stream = self.engine.streams.get(request_id)
        if done is not None and stream is not None:
            old = stream.detokenizer
            stream.detokenizer = Detokenizer.resume(
                self.engine.decode, old.stop, done.output_token_ids, done.emitted_text,
                old.min_tokens, old.whole_text_only,
            )  # fmt: skip
            stream.num_output_tokens = len(done.output_token_ids)
        self.engine.engine.pull_done(request_id, done.output_token_ids if done else None)

    def _count_groups(self, task: PullTask, after: int, overlapped: int) -> None:
        if self.metrics is None or task.kind is not CacheKind.KV:
            return
        counter = self.metrics.kv_groups_pulled
        labels = self.metrics.labels
        counter.labels(**labels, overlapped="true").inc(overlapped)
        counter.labels(**labels, overlapped="false").inc(after)

    def _target_lost(self, request_id: str) -> None:
        """The target of a hand-off died before pulling. Still prefilling here: offer it
        again when prefill ends; already parked: free it (the router re-routes it)."""
        watch = self.watches.pop(request_id, None)
        if watch is not None and watch.done is None:
            self.handed_to.pop(request_id, None)
            return
        self.release(request_id)

    async def _watch_peers(self, interval_s: float = 1.0) -> None:
        """Peers that left the router's table: drop our connections and mappings to them, and
        free what we parked for a target that died before releasing it (the router re-routes
        that request; nobody will pull these pages)."""
        while True:
            await asyncio.sleep(interval_s)
            if not self.link.instances:
                continue  # no table yet (or the router is away): keep what we have
            alive = {i.instance_id for i in self.link.instances}
            for instance_id in self.peers - alive:
                self.backend.forget(instance_id)
                self.peers.discard(instance_id)
            for request_id, target in list(self.handed_to.items()):
                # not in the table: dead, or alive in a draining pool (which still pulls)
                if target.instance_id not in alive and not await self._answers(target):
                    log.warning("%s died before pulling %s", target.instance_id, request_id)
                    self._target_lost(request_id)

    async def _answers(self, target: InstanceLoad) -> bool:
        try:
            response = await self.http.get(f"{target.url}/health/live", timeout=2.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def _release_source(self, task: PullTask) -> None:
        try:
            await self.http.post(
                f"{task.source.source_url}/internal/migrations/{task.request_id}/release",
                headers=self.headers,
                timeout=10.0,
            )
        except httpx.HTTPError as exc:  # the source frees it when its heartbeat lapses
            log.warning(
                "release of %s at %s failed: %r", task.request_id, task.source.source_url, exc
            )

    async def _pull_failed(self, task: PullTask, reason: str) -> None:
        stream = self.engine.streams.get(task.request_id)
        recomputing = await self.engine.call_async(
            lambda: self.engine.engine.pull_failed(task.request_id)
        )
        if not recomputing:
            self.engine.call(lambda: self.engine.abort(task.request_id))
            if stream is not None and stream.routing is not None:
                await self.link.retry(stream.routing, f"pull failed: {reason}")
        # Either way the source's copy is no longer needed: a live source frees its pages
        # now instead of holding them for a pull that will never come.
        await self._release_source(task)


def _changed(watches: list[PrefillWatch]) -> None:
    for watch in watches:
        watch.changed()
