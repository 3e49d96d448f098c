"""``nixl`` backend: any host, CPU or CUDA caches, through NIXL (the library Dynamo, llm-d and
vLLM move caches with). Over UCX it reads with RDMA (GPUDirect where the NIC and GPU allow),
CUDA IPC or a single kernel copy (CMA) on one host, and TCP otherwise; UCX picks per peer.

Connect (once per peer): every instance registers its cache tensors with its own NIXL agent
at start (``nixl_agent.Agent``). ``describe()`` carries the agent's name, its metadata
(base64: UCX worker address and memory keys, about 60 bytes per region) and each region's
address, page size and page count; a target loads the metadata as a remote agent on its
first pull from that peer, and again only when the peer's agent changed.

A pull is one NIXL READ: for each layer and each run of pages consecutive on both sides
(``pages.paired_runs``), a descriptor of the source's bytes and one of ours, so the bytes land
straight in our pages. It runs in a worker thread (NIXL's own progress thread moves them)
and is polled until done, an error, or ``timeout_s``; every failure is a ``TransferError``
and the caller recomputes. CUDA pages first wait for the work already queued on the
default stream (a page just handed to this request may still be read by it).

Trust: like ``shm`` and ``cuda_ipc``, a peer that holds our connection info reads whole
regions: NIXL has no per-request check, so ``Exports`` is not consulted. The metadata
travels only inside offers, which go to instances holding the internal token.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from epd_engine.contracts.host import host_id
from epd_engine.request import CacheKind
from epd_engine.transfer.backend import CacheRegions, PageTransfer, Peer, TransferError
from epd_engine.transfer.cuda_ipc import named_regions
from epd_engine.transfer.nixl_agent import Agent, nixl_api
from epd_engine.transfer.pages import page_nbytes, paired_runs


@dataclass(frozen=True)
class RemoteRegion:
    """One of a source's cache tensors as its ``describe()`` published it."""

    name: str
    addr: int
    page_nbytes: int
    num_pages: int
    device: int

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> RemoteRegion:
        device = tensor.device.index if tensor.is_cuda and tensor.device.index else 0
        return cls(name, tensor.data_ptr(), page_nbytes(tensor), tensor.shape[0], device)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "addr": self.addr, "page_nbytes": self.page_nbytes,
                "num_pages": self.num_pages, "device": self.device}  # fmt: skip

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> RemoteRegion:
        return cls(str(body["name"]), int(body["addr"]), int(body["page_nbytes"]),
                   int(body["num_pages"]), int(body["device"]))  # fmt: skip


def region_names(transfer: PageTransfer) -> list[str]:
    """The source regions a transfer reads (``cuda_ipc.named_regions``' names)."""
    if transfer.kind is CacheKind.IMAGE:
        return ["image"]
    return [f"kv.{i}" for i in range(transfer.layer_start, transfer.layer_stop)]


def read_rows(
    src: Sequence[RemoteRegion],
    dst: Sequence[torch.Tensor],
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
) -> tuple[np.ndarray, np.ndarray]:
    """NIXL descriptor rows ``[addr, nbytes, device]`` (ours, theirs): one per layer and run
    of pages consecutive on both sides. ``TransferError`` for pages outside either region or
    a page size that differs (the same model on both sides has the same)."""
    if len(src) != len(dst):
        raise TransferError(f"{len(src)} source regions for {len(dst)} layers here")
    try:
        runs = paired_runs(src_pages, dst_pages)
    except ValueError as exc:
        raise TransferError(str(exc)) from exc
    ours: list[tuple[int, int, int]] = []
    theirs: list[tuple[int, int, int]] = []
    for region, layer in zip(src, dst, strict=True):
        size = page_nbytes(layer)
        if region.page_nbytes != size:
            raise TransferError(f"{region.name}: {region.page_nbytes}-byte source pages, "
                                f"{size}-byte pages here")  # fmt: skip
        device = layer.device.index if layer.is_cuda and layer.device.index else 0
        for s, d, n in runs:
            if min(s, d) < 0 or s + n > region.num_pages or d + n > layer.shape[0]:
                raise TransferError(f"{region.name}: pages {s}+{n} -> {d}+{n} outside "
                                    f"{region.num_pages} -> {layer.shape[0]} pages")  # fmt: skip
            ours.append((layer.data_ptr() + d * size, n * size, device))
            theirs.append((region.addr + s * size, n * size, region.device))
    return np.array(ours, dtype=np.uint64), np.array(theirs, dtype=np.uint64)


@dataclass(frozen=True)
class PeerAgent:
    """What a source's ``describe()`` says about its agent, parsed."""

    agent: str
    metadata: bytes
    regions: dict[str, RemoteRegion]

    @classmethod
    def of(cls, peer: Peer, backend: str) -> PeerAgent:
        info = peer.info(backend)
        try:
            metadata = base64.b64decode(str(info["metadata"]), validate=True)
            regions = [RemoteRegion.from_json(r) for r in info["regions"]]
            return cls(str(info["agent"]), metadata, {r.name: r for r in regions})
        except (KeyError, TypeError, ValueError, binascii.Error) as exc:
            raise TransferError(f"malformed nixl info from {peer.instance_id}: {exc!r}") from exc

    def layers(self, transfer: PageTransfer) -> list[RemoteRegion]:
        try:
            return [self.regions[name] for name in region_names(transfer)]
        except KeyError as exc:
            raise TransferError(f"the source has no cache region {exc}") from None


class NixlBackend:
    name = "nixl"

    def __init__(self, regions: CacheRegions, timeout_s: float = 30.0) -> None:
        self.regions = regions
        self.timeout_s = timeout_s
        self._named = named_regions(regions)
        if not self._named:
            raise ValueError("the nixl backend needs cache tensors to register")
        self._api = nixl_api()
        self._lock = threading.Lock()
        self._agent = Agent(self._api, [t for _, t in self._named])
        self._info = self._describe(self._agent)
        self._closed = False

    def _describe(self, agent: Agent) -> dict[str, Any]:
        return {
            "agent": agent.name,
            "metadata": base64.b64encode(agent.metadata).decode(),
            "regions": [RemoteRegion.of(n, t).to_json() for n, t in self._named],
            "host": host_id(),
        }

    def describe(self) -> dict[str, Any]:
        return {self.name: self._info}

    # ---- target side ------------------------------------------------------------------
    async def pull(self, peer: Peer, transfer: PageTransfer) -> None:
        theirs = PeerAgent.of(peer, self.name)
        dst = self.regions.layers(transfer.kind, transfer.layer_start, transfer.layer_stop)
        ours, rows = read_rows(theirs.layers(transfer), dst, transfer.src_pages,
                               transfer.dst_pages)  # fmt: skip
        ready = None
        if dst[0].is_cuda:  # our pages may still be read by kernels queued before the pull
            ready = torch.cuda.Event()
            ready.record(torch.cuda.default_stream(dst[0].device))
        await asyncio.to_thread(self._read, peer.instance_id, theirs, ours, rows, ready)

    def _read(
        self,
        instance_id: str,
        theirs: PeerAgent,
        ours: np.ndarray,
        rows: np.ndarray,
        ready: torch.cuda.Event | None,
    ) -> None:
        if ready is not None:
            ready.synchronize()
        agent = self._current()
        try:
            remote = agent.remote(instance_id, theirs.agent, theirs.metadata)
            if agent.read(remote, ours, rows, self.timeout_s):
                return
        except TransferError:
            agent.forget(instance_id)  # a fresh endpoint on the next pull
            raise
        finally:
            agent.done()
        self._retire(agent)
        raise TransferError(f"read from {instance_id} still running after {self.timeout_s}s")

    def _current(self) -> Agent:
        with self._lock:
            agent = self._agent
        if not agent.use():  # retired between the two lines, or closed
            raise TransferError("the NIXL agent was replaced; retry the pull")
        return agent

    def _retire(self, agent: Agent) -> None:
        """A read outlived its deadline: no late byte may reach pages we give back, so this
        agent goes (with every peer's connection) and a new one takes its place at once, so
        our next offers describe it (peers reading the old one fail once and recompute)."""
        with self._lock:
            if self._agent is agent and not self._closed:
                self._agent = Agent(self._api, [t for _, t in self._named])
                self._info = self._describe(self._agent)
        agent.retire()

    def forget(self, instance_id: str) -> None:
        with self._lock:
            agent = self._agent
        agent.forget(instance_id)

    # ---- source side ------------------------------------------------------------------
    async def control(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        raise TransferError(f"the nixl backend has no control operation {op!r}")

    async def close(self) -> None:
        with self._lock:
            self._closed = True
            agent = self._agent
        agent.retire()
