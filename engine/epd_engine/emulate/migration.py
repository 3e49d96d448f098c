"""Migrations between emulated instances: the real protocol's control plane, with the data
plane's time taken from the cost model (DESIGN.md §4, four steps).

What is real: the messages and routes (``MigrationOffer`` to ``POST /internal/migrations``
of the target, ``POST /internal/migrations/{id}/release`` back to the source), the target
choice (the engine's policy: one in this placement group within a load bound, else the
affinity key's instance within a load bound, else one on this node, else the least loaded;
``contracts/group_locality.py``), the
page accounting on both sides (the source's pages held until the release; the target's
scheduler allocates pages and issues the ``PullTask``, prefix pages it holds are not
pulled), the router's hand-over (the target announces itself, then reports the migration's
kind and seconds) and the re-route when no target takes a request.

What is emulated: no bytes move. A pull sleeps the cost model's link time for the bytes the
model's shape gives (``EmulatedCosts.migration_bytes``: KV bytes per token, image-cache row
bytes per image token), and those bytes are counted (``epd_emulated_migration_bytes_total``).
KV is offered once prefill has ended (no early offer: the time is the link's for the whole
KV), and there is no transfer backend to connect to (``transfer`` in the offer is empty).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

import httpx
from starlette.requests import Request
from starlette.routing import Route

from epd_engine.config import Stage
from epd_engine.contracts.affinity import PrefixAffinity
from epd_engine.contracts.errors import ClientError
from epd_engine.contracts.group_locality import choose_handoff, locality
from epd_engine.contracts.routing_policy import InstanceLoad
from epd_engine.disagg.offers import send_offer, stage_targets
from epd_engine.disagg.router_link import RouterLink
from epd_engine.emulate.engine import EmulatedEngine
from epd_engine.emulate.http import route
from epd_engine.emulate.instance_metrics import InstanceMetrics
from epd_engine.emulate.loop import EmulatedLoop
from epd_engine.emulate.relay import announce, start_relay
from epd_engine.request import CacheKind, ImageRef, PullSpec
from epd_engine.request import Request as EngineRequest
from epd_engine.scheduler.output import PullTask
from epd_engine.transfer.messages import ImageInfo, MigrationOffer, Routing, SamplingInfo

log = logging.getLogger(__name__)

# how long a source waits for a peer of the next stage in its table (as ``disagg/peers.py``)


class EmulatedMigration:
    def __init__(
        self,
        loop: EmulatedLoop,
        link: RouterLink,
        metrics: InstanceMetrics,
        relays: dict[str, asyncio.Task[None]],
        http: httpx.AsyncClient,
        token: str,
    ) -> None:
        self.loop = loop
        self.engine = loop.engine
        self.link = link
        self.metrics = metrics
        self.relays = relays
        self.http = http
        self.headers = {"X-EPD-Token": token}
        self.policy = PrefixAffinity()
        self.routings: dict[str, Routing] = {}  # requests here, by id: how they reach clients
        self.tasks: set[asyncio.Task[None]] = set()
        loop.handoffs = self

    def follow(self, request_id: str, routing: Routing) -> None:
        """A request that may be handed on from here (the router's submit, or an offer)."""
        self.routings[request_id] = routing

    def ended(self, request_id: str) -> None:
        """Its relay ended: forget it unless it is parked here for its target's pull."""
        if request_id not in self.engine.scheduler.migrating:
            self.routings.pop(request_id, None)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    # ---- source: steps 1 and 4 ------------------------------------------------------------
    def on_handoff(self, request: EngineRequest) -> None:
        self._spawn(self._hand_off(request))

    async def _hand_off(self, request: EngineRequest) -> None:
        routing = self.routings.get(request.request_id)
        if routing is None:  # not a router request (cannot happen behind a router)
            self.engine.abort(request.request_id)
            return
        stage = request.next_stage
        offer = self._offer(request, routing)
        if await self._place(offer, stage) is not None:
            return
        log.error("no %s instance took %s", stage.value, request.request_id)
        self.release(request.request_id)
        await self.link.retry(routing, f"no instance for {stage.value}")

    def _offer(self, request: EngineRequest, routing: Routing) -> MigrationOffer:
        scheduler = self.engine.scheduler
        kind = CacheKind.IMAGE if request.next_stage is Stage.PREFILL else CacheKind.KV
        image_pages: list[list[int]] = []
        if kind is CacheKind.IMAGE and scheduler.images is not None:
            image_pages = [list(s.blocks) for s in scheduler.images.slots(request.request_id)]
        kv_pages: list[int] = []
        if kind is CacheKind.KV and scheduler.kv is not None:
            used = -(-request.num_computed_tokens // scheduler.kv.block_size)
            kv_pages = list(scheduler.kv.block_table(request.request_id)[:used])
        return MigrationOffer(
            request_id=request.request_id,
            kind=kind,
            source_url=self.link.identity.url,
            source_instance=self.link.identity.instance_id,
            prompt_token_ids=request.prompt_token_ids,
            images=[ImageInfo(**vars(i)) for i in request.images],
            sampling=SamplingInfo.of(request.sampling),
            eos_token_ids=sorted(request.eos_token_ids),
            output_token_ids=request.output_token_ids,
            num_computed_tokens=request.num_computed_tokens,
            image_pages=image_pages,
            kv_pages=kv_pages,
            routing=routing.model_copy(update={"path": [*routing.path, self.link.identity.pool]}),
        )

    async def _place(self, offer: MigrationOffer, stage: Stage) -> InstanceLoad | None:
        """Offer to the instance of ``stage`` the engine's policy picks that takes it."""
        candidates = await self._targets(stage)
        key = offer.routing.affinity_key if stage is not Stage.ENCODE else None
        me = self.link.identity
        while candidates:
            target, _ = choose_handoff(self.policy, candidates, key, me)
            candidates.remove(target)
            if await self._send_offer(target, offer):
                m, where = self.metrics.metrics, locality(me, target).value
                m.handoffs.labels(**m.labels, kind=offer.kind.value, locality=where).inc()
                return target
        return None

    async def _targets(self, stage: Stage) -> list[InstanceLoad]:
        return await stage_targets(self.link, stage)

    async def _send_offer(self, target: InstanceLoad, offer: MigrationOffer) -> bool:
        return await send_offer(self.http, self.headers, target, offer)

    def on_evicted(self, request_id: str) -> None:
        routing = self.routings.pop(request_id, None)
        if routing is not None:
            self._spawn(self.link.retry(routing, "evicted: out of KV cache pages"))

    def release(self, request_id: str) -> None:
        """Step 4 on the source (or a hand-off nobody took): free the parked pages."""
        self.routings.pop(request_id, None)
        self.loop.release(request_id)

    # ---- target: steps 1 to 3 -------------------------------------------------------------
    def accept(self, offer: MigrationOffer) -> None:
        """Queue the request (its pull is issued when the scheduler has pages for it) and
        relay its events; ``ValueError`` when it could never fit here."""
        images = [ImageRef(**i.model_dump()) for i in offer.images]
        request = EngineRequest(
            request_id=offer.request_id,
            prompt_token_ids=offer.prompt_token_ids,
            sampling=offer.sampling.params(),
            images=images,
            eos_token_ids=frozenset(offer.eos_token_ids),
            num_encoded_images=len(images),
            num_computed_tokens=offer.num_computed_tokens if offer.kind is CacheKind.KV else 0,
            output_token_ids=list(offer.output_token_ids),
            pull=PullSpec(
                offer.kind,
                offer.source_url,
                offer.source_instance,
                image_pages=tuple(tuple(ps) for ps in offer.image_pages),
                kv_pages=tuple(offer.kv_pages),
            ),
        )
        self.engine.scheduler.check_fits(request)
        routing = offer.routing
        self.follow(request.request_id, routing)
        start_relay(
            self.relays, self.link, self.metrics.metrics, routing, request.request_id,
            self.loop.generate(request), None, len(offer.prompt_token_ids),
            len(offer.output_token_ids), on_end=self.ended,
        )  # fmt: skip
        announce(self.link, routing)

    def on_pull(self, task: PullTask) -> None:
        self._spawn(self._pull(task))

    async def _pull(self, task: PullTask) -> None:
        """The cost model's time for the bytes this pull would move, then the request runs
        here and the source frees its copy."""
        started = time.monotonic()
        kind = task.kind.value
        tokens = _tokens_moved(task, self.engine)
        await asyncio.sleep(self.engine.costs.migration_s(kind, tokens))
        self.engine.scheduler.pull_done(task.request_id)
        self.loop.wake()
        seconds = time.monotonic() - started
        self.metrics.record_pull(kind, self.engine.costs.migration_bytes(kind, tokens), seconds)
        routing = self.routings.get(task.request_id)
        if routing is not None:
            self.link.send_raw(
                {
                    "router_request_id": routing.router_request_id,
                    "attempt": routing.attempt,
                    "instance_id": self.link.identity.instance_id,
                    "pool": self.link.identity.pool,
                    "migration": {"kind": kind, "seconds": seconds},
                }
            )
        await self._release_source(task)

    async def _release_source(self, task: PullTask) -> None:
        url = f"{task.source.source_url}/internal/migrations/{task.request_id}/release"
        try:
            await self.http.post(url, headers=self.headers, timeout=10.0)
        except httpx.HTTPError as exc:
            log.warning("release of %s at %s failed: %r", task.request_id, url, exc)


def _tokens_moved(task: PullTask, engine: EmulatedEngine) -> int:
    """Tokens whose cache this pull moves: the KV the target does not hold already, or the
    tokens of the images not in its encoder cache."""
    if task.kind is CacheKind.KV:
        block_size = engine.capacity.kv_block_size
        return max(0, task.num_kv_tokens - task.num_held_kv_pages * block_size)
    request = engine.scheduler.requests.get(task.request_id)
    if request is None:
        return 0
    return sum(request.images[index].num_tokens for index in task.image_blocks)


def _migration(request: Request) -> EmulatedMigration:
    migration: EmulatedMigration | None = request.app.state.emulated.migration
    if migration is None:
        raise ClientError("this instance has no router link")
    return migration


async def offer(request: Request, offer: MigrationOffer) -> dict[str, str]:
    try:
        _migration(request).accept(offer)
    except ValueError as exc:  # could never fit here: the source offers it elsewhere
        raise ClientError(str(exc)) from exc
    return {"status": "queued"}


async def release(request: Request) -> dict[str, str]:
    _migration(request).release(request.path_params["request_id"])
    return {"status": "released"}


ROUTES: list[Route] = [
    route("/internal/migrations", offer, "POST", body=MigrationOffer, internal=True),
    route("/internal/migrations/{request_id}/release", release, "POST", internal=True),
]
