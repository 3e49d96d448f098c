"""``collective`` and ``nccl`` backends: the migration protocol over a point-to-point
``Communicator``, chosen by name (``collective``: gloo, CPU caches; ``nccl``: NCCL through
CuPy, CUDA caches). Everything below is the same for both; gloo runs it in CPU tests.

Connect (once per peer): the target hosts a rendezvous store and asks the source, over
HTTP (``POST /internal/transfer/{collective|nccl}/connect``: a fresh group key and the
store's address), to join a two-rank group; both sides form it concurrently
(``communicator.form_pair``: NCCL's unique id goes through the store as JSON), and the
source starts a thread that serves the group.

A pull then never leaves the group: the target sends a JSON header (its length, then its
bytes) naming the request, kind, layers, source and destination pages and the first data
tag; the source checks the pages against what the request exposes and answers a status
(an error text, or nothing). Then, for every layer and every run of pages consecutive on
both sides, the source sends its slice of the cache and the target receives straight into
its own slice: no staging buffer, no gather or scatter. One transfer at a time per group
keeps both sides' message order, which is all NCCL (no tags) will need.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import uuid
from typing import Any

import httpx
import torch

from epd_engine.transfer.backend import (
    CacheRegions,
    Exports,
    PageTransfer,
    Peer,
    TransferError,
    requested_layers,
)
from epd_engine.transfer.communicator import Communicator, form_pair, rendezvous_store
from epd_engine.transfer.pages import paired_runs

log = logging.getLogger(__name__)
HEADER_LEN_TAG, HEADER_TAG, STATUS_LEN_TAG, STATUS_TAG = 1, 2, 3, 4
FIRST_DATA_TAG = 16
BACKEND_OF = {"gloo": "collective", "nccl": "nccl"}  # communicator -> backend name
IDLE_GROUP_TIMEOUT_S = 365 * 24 * 3600.0  # the source's serving thread waits for pulls


def send_bytes(comm: Communicator, data: bytes, len_tag: int, tag: int, timeout_s: float) -> None:
    comm.send(torch.tensor([len(data)], dtype=torch.int64), len_tag, timeout_s)
    if data:
        comm.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), tag, timeout_s)


def recv_bytes(comm: Communicator, len_tag: int, tag: int, timeout_s: float | None) -> bytes:
    size = torch.zeros(1, dtype=torch.int64)
    comm.recv(size, len_tag, timeout_s)
    if not 0 <= int(size) <= 1 << 24:
        raise TransferError(f"implausible message of {int(size)} bytes")
    data = torch.empty(int(size), dtype=torch.uint8)
    if int(size):
        comm.recv(data, tag, timeout_s)
    return data.numpy().tobytes()


def data_messages(
    layers: list[torch.Tensor], src: list[int], dst: list[int], on_source: bool
) -> list[torch.Tensor]:
    """The slices both sides exchange, in the same order: per layer, per paired run."""
    pieces = paired_runs(src, dst)
    return [layer[s : s + n] if on_source else layer[d : d + n]
            for layer in layers for s, d, n in pieces]  # fmt: skip


class _GroupServer:
    """Source side of one group: a thread that answers the target's pulls in order."""

    def __init__(self, comm: Communicator, regions: CacheRegions, exports: Exports) -> None:
        self.comm = comm
        self.regions = regions
        self.exports = exports
        threading.Thread(target=self._run, name="epd-collective-serve", daemon=True).start()

    def _run(self) -> None:
        try:
            while True:
                header = json.loads(recv_bytes(self.comm, HEADER_LEN_TAG, HEADER_TAG, None))
                try:
                    messages = self._messages(header)
                except (TransferError, KeyError, TypeError, ValueError) as exc:
                    send_bytes(self.comm, str(exc).encode(), STATUS_LEN_TAG, STATUS_TAG, 30)
                    continue
                send_bytes(self.comm, b"", STATUS_LEN_TAG, STATUS_TAG, 30)
                tag = int(header["first_tag"])
                for offset, message in enumerate(messages):
                    self.comm.send(message, tag + offset, 30)
        except (RuntimeError, ValueError) as exc:  # the target left or broke the protocol
            log.info("collective group ended: %r", exc)
            self.comm.close()

    def _messages(self, header: dict[str, Any]) -> list[torch.Tensor]:
        layers, src = requested_layers(header, self.exports, self.regions)
        try:
            dst = [int(p) for p in header["dst_pages"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise TransferError(f"malformed transfer header: {exc!r}") from exc
        return data_messages(layers, src, dst, on_source=True)


def cache_device(regions: CacheRegions) -> torch.device:
    tensors = [*regions.kv, *([regions.image] if regions.image is not None else [])]
    return tensors[0].device if tensors else torch.device("cpu")


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
        communicator: str = "gloo",
    ) -> None:
        if communicator not in BACKEND_OF:
            raise ValueError(f"unknown communicator {communicator!r}")
        self.communicator = communicator
        self.name = BACKEND_OF[communicator]
        self.device = cache_device(regions)
        if communicator == "nccl" and self.device.type != "cuda":
            raise ValueError(f"the nccl backend moves CUDA caches; these are on {self.device}")
        self.regions = regions
        self.exports = exports
        self.http = http
        self.headers = {"X-EPD-Token": token}
        self.bind_host = bind_host
        self.advertise_host = advertise_host
        self.timeout_s = timeout_s
        self._groups: dict[str, Communicator] = {}  # target side, by peer id
        self._next_tag: dict[str, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._served: list[_GroupServer] = []  # source side

    def describe(self) -> dict[str, Any]:
        return {self.name: {"host": self.advertise_host}}

    # ---- target side ------------------------------------------------------------------
    async def pull(self, peer: Peer, transfer: PageTransfer) -> None:
        lock = self._locks.setdefault(peer.instance_id, asyncio.Lock())
        async with lock:  # one transfer in flight per group keeps both sides in step
            comm = await self._group(peer)
            dst = self.regions.layers(transfer.kind, transfer.layer_start, transfer.layer_stop)
            messages = data_messages(
                dst, list(transfer.src_pages), list(transfer.dst_pages), on_source=False
            )
            first_tag = self._next_tag.get(peer.instance_id, FIRST_DATA_TAG)
            self._next_tag[peer.instance_id] = (first_tag + len(messages)) % (
                1 << 30
            ) or FIRST_DATA_TAG
            header = {**transfer.to_json(), "dst_pages": list(transfer.dst_pages),
                      "first_tag": first_tag}  # fmt: skip
            try:
                await asyncio.to_thread(self._exchange, comm, header, messages, first_tag)
            except TransferError:
                raise  # refused: the group is fine
            except RuntimeError as exc:
                self.forget(peer.instance_id)
                raise TransferError(f"transfer with {peer.instance_id} failed: {exc}") from exc

    def _exchange(
        self, comm: Communicator, header: dict[str, Any], messages: list[torch.Tensor], tag: int
    ) -> None:
        send_bytes(comm, json.dumps(header).encode(), HEADER_LEN_TAG, HEADER_TAG, self.timeout_s)
        error = recv_bytes(comm, STATUS_LEN_TAG, STATUS_TAG, self.timeout_s)
        if error:
            raise TransferError(f"refused: {error.decode(errors='replace')}")
        for offset, message in enumerate(messages):
            comm.recv(message, tag + offset, self.timeout_s)  # straight into our pages

    async def _group(self, peer: Peer) -> Communicator:
        if (comm := self._groups.get(peer.instance_id)) is not None:
            return comm
        peer.info(self.name)  # the peer must serve this backend at all
        key = uuid.uuid4().hex
        try:
            store = await asyncio.to_thread(
                rendezvous_store, self.bind_host, 0, True, self.timeout_s
            )
        except RuntimeError as exc:
            raise TransferError(f"cannot host a rendezvous: {exc}") from exc
        join = {"key": key, "host": self.advertise_host, "port": store.port}
        formed = asyncio.ensure_future(asyncio.to_thread(self._form, store, key, 1))
        try:
            await self._post(peer, "connect", join)
            comm = await formed
        except (TransferError, RuntimeError) as exc:
            formed.cancel()
            raise TransferError(f"cannot form a group with {peer.instance_id}: {exc}") from exc
        self._groups[peer.instance_id] = comm
        return comm

    def _form(self, store: Any, key: str, rank: int) -> Communicator:
        return form_pair(self.communicator, store, key, rank, self.bind_host, self.device,
                         IDLE_GROUP_TIMEOUT_S)  # fmt: skip

    async def _post(self, peer: Peer, op: str, body: dict[str, Any]) -> None:
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

    def forget(self, instance_id: str) -> None:
        self._next_tag.pop(instance_id, None)
        comm = self._groups.pop(instance_id, None)
        if comm is not None:
            comm.close()

    # ---- source side ------------------------------------------------------------------
    async def control(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        if op != "connect":
            raise TransferError(f"the {self.name} backend has no control operation {op!r}")
        try:
            key, host, port = str(body["key"]), str(body["host"]), int(body["port"])
        except (KeyError, TypeError, ValueError) as exc:
            raise TransferError(f"malformed connect message: {exc!r}") from exc

        def form() -> Communicator:
            return self._form(rendezvous_store(host, port, False, self.timeout_s), key, 0)

        try:
            comm = await asyncio.to_thread(form)
        except RuntimeError as exc:
            raise TransferError(f"cannot join group {key}: {exc}") from exc
        self._served.append(_GroupServer(comm, self.regions, self.exports))
        return {"status": "joined"}

    async def close(self) -> None:
        for instance_id in list(self._groups):
            self.forget(instance_id)
        for server in self._served:
            server.comm.close()
