"""The target side of a pull-based migration (DESIGN.md §4, steps 1 to 4).

An offer is queued (step 1); when the scheduler has pages for it, it emits a ``PullTask``
(2) and the transfer backend copies the source's pages straight into ours, KV in layer
groups (3) -- an early offer's groups as the source's prefill writes them
(``early_handoff.py``). Then the request runs here and the source is told to free its copy
(4). If the pull fails or times out, the request is recomputed here when the role allows,
otherwise the router re-routes it: the request is never lost.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from epd_engine.config import env_str
from epd_engine.disagg.background import Background
from epd_engine.disagg.early_handoff import SourceEnded, layer_groups, pull_groups
from epd_engine.disagg.hooks import EngineHooks, RouterPort
from epd_engine.disagg.peers import Peers
from epd_engine.engine.async_engine import RequestOutput, RequestOutputStream
from epd_engine.engine.detokenizer import Detokenizer
from epd_engine.metrics import Metrics
from epd_engine.request import CacheKind, ImageRef, PullSpec, Request
from epd_engine.scheduler.output import PullTask
from epd_engine.transfer.backend import PageTransfer, Peer, TransferBackend, TransferError
from epd_engine.transfer.messages import MigrationOffer, PrefillDone, PrefillProgress
from epd_engine.transfer.plan import transfers_for

log = logging.getLogger(__name__)


class Target:
    def __init__(
        self,
        hooks: EngineHooks,
        link: RouterPort,
        peers: Peers,
        backend: TransferBackend,
        background: Background,
        http: httpx.AsyncClient,
        token: str,
        layers_per_group: int = 8,
        metrics: Metrics | None = None,
    ) -> None:
        self.hooks = hooks
        self.link = link
        self.peers = peers
        self.backend = backend
        self.background = background
        self.http = http
        self.headers = {"X-EPD-Token": token}
        self.layers_per_group = layers_per_group
        self.metrics = metrics
        self.loop = asyncio.get_running_loop()
        # fault injection for tests: hold each pull this long, so a test can kill the source
        self.pull_delay_s = float(env_str("FAULT_PULL_DELAY_S", "0"))

    async def accept(self, offer: MigrationOffer) -> None:
        """Step 1 on the target: queue the request; it pulls when scheduled."""
        sampling = offer.sampling.params()
        detokenizer = Detokenizer.resume(
            self.hooks.decode,
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
        await self.hooks.admit(request, stream)
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
        self.background.spawn(self.link.retry(stream.routing, "evicted: out of KV cache pages"))

    def on_pull(self, task: PullTask) -> None:
        """Engine thread: a PullTask was scheduled; do the I/O on the event loop."""
        issued_s = time.monotonic()
        self.loop.call_soon_threadsafe(lambda: self.background.spawn(self._pull(task, issued_s)))

    async def _pull(self, task: PullTask, issued_s: float) -> None:
        """The migration's time runs from the pull's scheduling to the bytes being in our
        pages; the wait for the engine's next iteration after that is queueing (it is in
        the stage's queue time, and the simulator models it as such)."""
        if self.pull_delay_s:
            await asyncio.sleep(self.pull_delay_s)
        peer = self.peers.source(task.source)
        done: PrefillDone | None = None
        try:
            if task.source.early:
                done, issued_s = await self._pull_early(task, peer)
            else:
                transfers = transfers_for(
                    task,
                    self.hooks.num_layers,
                    self.layers_per_group,
                    self.hooks.kv_block_size,
                    self.hooks.layer_windows,
                )
                for transfer in transfers:  # each lands in our pages as it completes
                    await self._pull_one(peer, transfer)
                self._count_groups(task, len(transfers), 0)
        except SourceEnded:  # finished at its first token, or aborted: nothing to go on with
            self.hooks.abort(task.request_id)
            return
        except Exception as exc:  # TransferError or a broken peer: never hang
            log.warning("pull of %s from %s failed: %r", task.request_id, peer.instance_id, exc)
            await self._pull_failed(task, str(exc))
            return
        finally:
            self.hooks.release_pull(task.request_id)

        seconds = time.monotonic() - issued_s
        self._observe_pull(task, peer, seconds)
        # Read before landing: once landed, the engine may finish its stage and hand the
        # request on (dropping the stream) before this coroutine runs again.
        stream = self.hooks.stream(task.request_id)
        await self.hooks.land(task.request_id, done)
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
        groups = layer_groups(self.hooks.num_layers, self.layers_per_group)

        async def poll(version: int) -> PrefillProgress:
            return await self._poll_progress(task, version)

        async def pull(transfer: PageTransfer) -> None:
            await self._pull_one(peer, transfer)

        block_size = self.hooks.kv_block_size
        windows = self.hooks.layer_windows
        done, done_s, overlapped = await pull_groups(task, groups, block_size, poll, pull, windows)
        self._count_groups(task, len(groups) - overlapped, overlapped)
        return done, done_s

    async def _pull_one(self, peer: Peer, transfer: PageTransfer) -> None:
        """One transfer into our pages (through staging pages on a tensor-parallel
        instance, whose ranks each take their heads from there)."""
        staged = self.hooks.stage_pull(transfer)
        await self.backend.pull(peer, staged)
        await self.hooks.land_pull(transfer, staged)

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

    def _observe_pull(self, task: PullTask, peer: Peer, seconds: float) -> None:
        """epd_migration_pull_seconds by kind and the backend that moved the bytes (``auto``
        says which one it chose for this peer)."""
        if self.metrics is None:
            return
        label = getattr(self.backend, "label", None)
        backend = label(peer) if label is not None else self.backend.name
        labels = self.metrics.labels
        self.metrics.migration_pull.labels(**labels, kind=task.kind.value, backend=backend).observe(
            seconds
        )

    def _count_groups(self, task: PullTask, after: int, overlapped: int) -> None:
        if self.metrics is None or task.kind is not CacheKind.KV:
            return
        counter = self.metrics.kv_groups_pulled
        labels = self.metrics.labels
        counter.labels(**labels, overlapped="true").inc(overlapped)
        counter.labels(**labels, overlapped="false").inc(after)

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
        stream = self.hooks.stream(task.request_id)
        if not await self.hooks.recompute(task.request_id):
            self.hooks.abort(task.request_id)
            if stream is not None and stream.routing is not None:
                await self.link.retry(stream.routing, f"pull failed: {reason}")
        # Either way the source's copy is no longer needed: a live source frees its pages
        # now instead of holding them for a pull that will never come.
        await self._release_source(task)
