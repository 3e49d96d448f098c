"""Both sides of pull-based migration on one instance (DESIGN.md §4).

Source: when a request's next stage lives elsewhere, expose its pages and offer it to the
least-loaded instance of that stage (step 1); its transfer backend serves the pages (3);
free them on release (4). Target: queue the offer; when the scheduler has pages it emits a
PullTask; the backend copies the source's pages straight into ours (KV in layer groups),
then the request runs here and the source is released. If the pull fails, recompute here
when the role allows, otherwise ask the router to re-route: the request is never lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import cast

import httpx

from epd_engine.async_engine import AsyncEngine, RequestOutput, RequestOutputStream
from epd_engine.config import Stage, env_str
from epd_engine.detokenizer import Detokenizer
from epd_engine.request import CacheKind, ImageRef, PullSpec, Request
from epd_engine.router.policy import InstanceLoad, LeastLoaded
from epd_engine.scheduler.output import PullTask
from epd_engine.server.router_link import RouterLink
from epd_engine.transfer.backend import Exports, Peer, TransferBackend
from epd_engine.transfer.messages import ImageInfo, MigrationOffer, SamplingInfo
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
        self.policy = LeastLoaded()
        self.loop = asyncio.get_running_loop()
        # fault injection for tests: hold each pull this long, so a test can kill the source
        self.pull_delay_s = float(env_str("FAULT_PULL_DELAY_S", "0"))
        self._tasks: set[asyncio.Task[None]] = set()
        engine.on_handoff = self.on_handoff
        engine.on_pull = self.on_pull
        engine.on_evicted = self.on_evicted
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
        kind = CacheKind.IMAGE if request.next_stage is Stage.PREFILL else CacheKind.KV
        exposed = await self.engine.call_async(
            lambda: self.engine.engine.exposed_pages(request.request_id)
        )
        image_pages, kv_pages = cast(tuple[tuple[tuple[int, ...], ...], tuple[int, ...]], exposed)
        pages = kv_pages if kind is CacheKind.KV else [p for ps in image_pages for p in ps]
        self.exports.expose(request.request_id, kind, pages)
        offer = self._offer(request, stream, kind, image_pages, kv_pages)
        candidates = await self._targets(request.next_stage)
        while candidates:
            target = self.policy.choose(candidates)
            candidates.remove(target)
            if await self._send_offer(target, offer):
                self.handed_to[request.request_id] = target
                return
        log.error("no %s instance took %s", request.next_stage.value, request.request_id)
        self.release(request.request_id)
        await self.link.retry(stream.routing, f"no instance for {request.next_stage.value}")

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
    ) -> MigrationOffer:
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
            num_computed_tokens=request.num_computed_tokens,
            image_pages=[list(ps) for ps in image_pages],
            kv_pages=list(kv_pages) if kind is CacheKind.KV else [],
            transfer=self.backend.describe(),
            emitted_text=stream.detokenizer.emitted,
            routing=routing,
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
        self.exports.withdraw(request_id)
        self.handed_to.pop(request_id, None)
        self.engine.call(lambda: self.engine.engine.release_migrated(request_id))

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
                ),
            )
            return self.engine.engine.add(request)

        await self.engine.add(make, stream)
        self.link.send(
            RequestOutput(offer.request_id, "", [], len(offer.prompt_token_ids),
                          len(offer.output_token_ids)),
            routing,
        )  # fmt: skip

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
        try:
            transfers = transfers_for(
                task, engine.num_layers, self.layers_per_group, engine.config.kv_block_size
            )
            self.peers.add(peer.instance_id)
            for transfer in transfers:  # each lands in our pages as it completes
                await self.backend.pull(peer, transfer)
        except Exception as exc:  # TransferError or a broken peer: never hang
            log.warning("pull of %s from %s failed: %r", task.request_id, peer.instance_id, exc)
            await self._pull_failed(task, str(exc))
            return

        seconds = time.monotonic() - issued_s
        # Read before landing: once landed, the engine may finish its stage and hand the
        # request on (dropping the stream) before this coroutine runs again.
        stream = self.engine.streams.get(task.request_id)
        await self.engine.call_async(lambda: engine.pull_done(task.request_id))
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
                    log.warning("%s died before pulling %s: freeing its pages",
                                target.instance_id, request_id)  # fmt: skip
                    self.release(request_id)

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
