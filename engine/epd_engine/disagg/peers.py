"""The other instances, as migration sees them (DESIGN.md §4, "Router").

The router link's heartbeats bring back the router's table of active instances: a source
offers each hand-off to an instance of the request's next stage that takes it -- a peer in
its own placement group (one pod) within a load bound (``contracts/group_locality.py``),
else for prefill and decode the one its affinity key prefers, within a load bound
(``contracts/affinity.py``: it holds the conversation's earlier pages), else and for images
the least-loaded one on the source's node within a bound (``contracts/node_locality.py``:
shared memory, not the network), else the least loaded.
A target's transfer backend connects to each source it pulls from once (on the first pull);
a source that leaves the table has its connection dropped, and the source side is told who
is alive (it frees what it parked for a target that died before pulling).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import httpx

from epd_engine.config import Stage
from epd_engine.contracts.affinity import PrefixAffinity
from epd_engine.contracts.group_locality import choose_handoff, locality
from epd_engine.contracts.routing_policy import InstanceLoad
from epd_engine.disagg.hooks import RouterPort
from epd_engine.disagg.offers import send_offer, stage_targets
from epd_engine.metrics import Metrics
from epd_engine.request import PullSpec
from epd_engine.transfer.backend import Peer, TransferBackend
from epd_engine.transfer.messages import MigrationOffer

log = logging.getLogger(__name__)
# How long a source waits for a peer of the next stage to appear in its table before it
# hands the request back to the router (longer than the router's 3 s instance timeout).


class Peers:
    def __init__(
        self,
        link: RouterPort,
        backend: TransferBackend,
        http: httpx.AsyncClient,
        token: str,
        metrics: Metrics | None = None,
    ) -> None:
        self.metrics = metrics
        self.link = link
        self.backend = backend
        self.http = http
        self.headers = {"X-EPD-Token": token}
        # prefill and decode go where the request's prefix is likely cached (within a load
        # bound); images to the least loaded (contracts/affinity.py)
        self.policy = PrefixAffinity()
        self.pulled_from: set[str] = set()  # sources we pulled from (the backend holds connections)

    # ---- target choice ----------------------------------------------------------------
    async def place(self, offer: MigrationOffer, stage: Stage) -> InstanceLoad | None:
        """Offer to the instance of ``stage`` its affinity key prefers (else the least
        loaded) that takes it; None if none does."""
        candidates = await self.targets(stage)
        key = offer.routing.affinity_key if stage is not Stage.ENCODE else None
        me = self.link.identity
        while candidates:
            target, affinity = choose_handoff(self.policy, candidates, key, me)
            if self.metrics is not None and affinity is not None:
                labels = self.metrics.labels
                self.metrics.affinity.labels(**labels, outcome=affinity.value).inc()
            candidates.remove(target)
            if await self._send_offer(target, offer):
                if self.metrics is not None:
                    where = locality(me, target).value
                    self.metrics.handoffs.labels(
                        **self.metrics.labels, kind=offer.kind.value, locality=where
                    ).inc()
                return target
        return None

    async def targets(self, stage: Stage) -> list[InstanceLoad]:
        """Peers that run ``stage`` (``offers.stage_targets``)."""
        return await stage_targets(self.link, stage)

    async def _send_offer(self, target: InstanceLoad, offer: MigrationOffer) -> bool:
        return await send_offer(self.http, self.headers, target, offer)

    # ---- connections ------------------------------------------------------------------
    def source(self, spec: PullSpec) -> Peer:
        """The transfer backend's handle on a source we pull from (remembered, so its
        connection is dropped once the source leaves the table)."""
        self.pulled_from.add(spec.source_instance)
        return Peer(spec.source_instance, spec.source_url, spec.descriptor)

    async def watch(
        self, on_table: Callable[[set[str]], Awaitable[None]], interval_s: float = 1.0
    ) -> None:
        """Peers that left the router's table: drop our connections and mappings to them;
        then ``on_table`` with the ids still in it (the source side checks its targets)."""
        while True:
            await asyncio.sleep(interval_s)
            if not self.link.instances:
                continue  # no table yet (or the router is away): keep what we have
            alive = {i.instance_id for i in self.link.instances}
            for instance_id in self.pulled_from - alive:
                self.backend.forget(instance_id)
                self.pulled_from.discard(instance_id)
            await on_table(alive)

    async def answers(self, target: InstanceLoad) -> bool:
        """Whether ``target`` is alive though not in the table (a draining pool still pulls)."""
        try:
            response = await self.http.get(f"{target.url}/health/live", timeout=2.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200
