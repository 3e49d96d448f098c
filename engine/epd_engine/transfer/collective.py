"""``collective`` backend: the migration protocol over a point-to-point ``Communicator``
(gloo on CPU here; NCCL through CuPy on GPUs behind the same interface).

Connect (once per peer): the target hosts a rendezvous store and asks the source, over
HTTP (``POST /internal/transfer/collective/connect``), to join a two-rank group; both
sides form it concurrently. A pull: the target posts a ``send`` control message naming
the pages, layers and a tag; the source checks them against what the request exposes and
queues the send on that group's sender thread (so sends leave in the order asked); the
target receives into one contiguous buffer and scatters it into its destination pages.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
import torch

from epd_engine.request import CacheKind
from epd_engine.transfer.backend import (
    CacheRegions,
    Exports,
    PageTransfer,
    Peer,
    TransferError,
)
from epd_engine.transfer.communicator import Communicator, GlooPair, rendezvous_store

log = logging.getLogger(__name__)


def gather(layers: list[torch.Tensor], pages: list[int]) -> torch.Tensor:
    """``[len(layers) * len(pages), *page]``: the pages of every layer, contiguous."""
    index = torch.tensor(pages, dtype=torch.long, device=layers[0].device)
    return torch.cat([layer.index_select(0, index) for layer in layers])


def scatter(buffer: torch.Tensor, layers: list[torch.Tensor], pages: list[int]) -> None:
    index = torch.tensor(pages, dtype=torch.long, device=layers[0].device)
    for layer, rows in zip(layers, buffer.split(len(pages)), strict=True):
        layer.index_copy_(0, index, rows)


@dataclass
class _Sender:
    """Source side of one group: a thread that runs queued sends in order."""

    comm: Communicator
    jobs: queue.Queue[tuple[list[torch.Tensor], list[int], int] | None] = field(
        default_factory=queue.Queue
    )

    def start(self) -> None:
        threading.Thread(target=self._run, name="epd-collective-send", daemon=True).start()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            layers, pages, tag = job
            try:
                self.comm.send(gather(layers, pages), tag)
            except RuntimeError as exc:  # the target gave up or died; it will recompute
                log.warning("collective send (tag %d) failed: %r", tag, exc)
                self.comm.close()
                return


class CollectiveBackend:
    name = "collective"

    def __init__(
        self,
        regions: CacheRegions,
        exports: Exports,
        http: httpx.AsyncClient,
        token: str,
        bind_host: str = "127.0.0.1",
        advertise_host: str = "127.0.0.1",
        timeout_s: float = 30.0,
    ) -> None:
        self.regions = regions
        self.exports = exports
        self.http = http
        self.headers = {"X-EPD-Token": token}
        self.bind_host = bind_host
        self.advertise_host = advertise_host
        self.timeout_s = timeout_s
        self._groups: dict[str, tuple[str, Communicator]] = {}  # peer id -> (key, group)
        self._locks: dict[str, asyncio.Lock] = {}
        self._senders: dict[str, _Sender] = {}  # source side, by group key
        self._tags = itertools.count(1)

    def describe(self) -> dict[str, Any]:
        return {self.name: {"host": self.advertise_host}}

    # ---- target side ------------------------------------------------------------------
    async def pull(self, peer: Peer, transfer: PageTransfer) -> None:
        lock = self._locks.setdefault(peer.instance_id, asyncio.Lock())
        async with lock:  # one transfer in flight per group keeps sends and recvs paired
            key, comm = await self._group(peer)
            dst = self.regions.layers(transfer.kind, transfer.layer_start, transfer.layer_stop)
            page = dst[0][0]
            buffer = torch.empty((len(dst) * len(transfer.dst_pages), *page.shape),
                                 dtype=page.dtype, device=page.device)  # fmt: skip
            tag = next(self._tags)
            await self._post(peer, "send", {"key": key, "tag": tag, **transfer.to_json()})
            try:
                await asyncio.to_thread(comm.recv, buffer, tag)
            except RuntimeError as exc:
                self.forget(peer.instance_id)
                raise TransferError(f"receive from {peer.instance_id} failed: {exc}") from exc
            await asyncio.to_thread(scatter, buffer, dst, list(transfer.dst_pages))

    async def _group(self, peer: Peer) -> tuple[str, Communicator]:
        if (group := self._groups.get(peer.instance_id)) is not None:
            return group
        peer.info(self.name)  # the peer must serve this backend at all
        key = uuid.uuid4().hex
        try:
            store = await asyncio.to_thread(
                rendezvous_store, self.bind_host, 0, True, self.timeout_s
            )
        except RuntimeError as exc:
            raise TransferError(f"cannot host a rendezvous: {exc}") from exc
        join = {"key": key, "host": self.advertise_host, "port": store.port}
        formed = asyncio.ensure_future(
            asyncio.to_thread(GlooPair, store, key, 1, self.bind_host, self.timeout_s)
        )
        try:
            await self._post(peer, "connect", join)
            comm = await formed
        except (TransferError, RuntimeError) as exc:
            formed.cancel()
            raise TransferError(f"cannot form a group with {peer.instance_id}: {exc}") from exc
        self._groups[peer.instance_id] = (key, comm)
        return key, comm

    async def _post(self, peer: Peer, op: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            response = await self.http.post(
                f"{peer.url}/internal/transfer/{self.name}/{op}",
                json=body,
                headers=self.headers,
                timeout=self.timeout_s,
            )
        except httpx.HTTPError as exc:
            raise TransferError(f"{op} to {peer.instance_id} failed: {exc!r}") from exc
        if response.status_code != 200:
            raise TransferError(f"{peer.instance_id} refused {op}: {response.text[:200]}")
        answer: dict[str, Any] = response.json()
        return answer

    def forget(self, instance_id: str) -> None:
        group = self._groups.pop(instance_id, None)
        if group is not None:
            group[1].close()

    # ---- source side ------------------------------------------------------------------
    async def control(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            if op == "connect":
                return await self._join(str(body["key"]), str(body["host"]), int(body["port"]))
            if op == "send":
                return self._queue_send(body)
        except (KeyError, TypeError, ValueError) as exc:
            raise TransferError(f"malformed {op} message: {exc!r}") from exc
        raise TransferError(f"the collective backend has no control operation {op!r}")

    async def _join(self, key: str, host: str, port: int) -> dict[str, Any]:
        def form() -> Communicator:
            store = rendezvous_store(host, port, False, self.timeout_s)
            return GlooPair(store, key, 0, self.bind_host, self.timeout_s)

        try:
            comm = await asyncio.to_thread(form)
        except RuntimeError as exc:
            raise TransferError(f"cannot join group {key}: {exc}") from exc
        sender = _Sender(comm)
        sender.start()
        self._senders[key] = sender
        return {"status": "joined"}

    def _queue_send(self, body: dict[str, Any]) -> dict[str, Any]:
        sender = self._senders.get(str(body["key"]))
        if sender is None:
            raise TransferError("no such group: connect first")
        kind = CacheKind(body["kind"])
        pages = [int(p) for p in body["src_pages"]]
        start, stop = (int(x) for x in body["layers"])
        self.exports.check(str(body["request_id"]), kind, pages)
        layers = self.regions.layers(kind, start, stop)
        sender.jobs.put((layers, pages, int(body["tag"])))
        return {"status": "queued"}

    async def close(self) -> None:
        for sender in self._senders.values():
            sender.jobs.put(None)
        for instance_id in list(self._groups):
            self.forget(instance_id)
