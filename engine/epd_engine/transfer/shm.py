"""``shm`` backend: same host, CPU. Caches live in memfd regions (``memory.SharedMemory``);
a peer maps the source's regions once, and a transfer is a direct page copy between the
two mappings -- one memcpy per run of pages, no socket, no source-side work.

Connect: the target opens the source's abstract Unix socket (named in the offer), proves
the internal token, and receives the regions' file descriptors (SCM_RIGHTS) with a JSON
header of names, shapes and dtypes (``region_share``, which ``cuda_ipc`` shares). It is the
CPU twin of CUDA IPC: handles exchanged once per peer, then copies between the two
processes' memory. The socket stays open: when the source dies the target sees EOF, drops
the mapping, and the pull fails cleanly.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

from epd_engine.contracts.host import host_id
from epd_engine.transfer.backend import CacheRegions, PageTransfer, Peer, TransferError
from epd_engine.transfer.memory import SharedMemory, map_region
from epd_engine.transfer.pages import copy_pages, page_nbytes
from epd_engine.transfer.region_share import (
    PeerRegions,
    RegionServer,
    fetch_regions,
)

# A copy this small takes less time (tens of microseconds) than the hop to a worker thread
# and back (~0.2 ms): do it on the event loop.
INLINE_COPY_BYTES = 1 << 20
MAX_REGIONS = 256


class ShmBackend:
    name = "shm"

    def __init__(self, memory: SharedMemory, regions: CacheRegions, token: str) -> None:
        self.memory = memory
        self.regions = regions
        self.token = token
        self.host = host_id()
        self._peers: dict[str, PeerRegions] = {}
        self._lock = threading.Lock()
        self._server = RegionServer("epd-shm", token, self._offer)
        self.socket_name = self._server.socket_name

    def describe(self) -> dict[str, Any]:
        return {self.name: {"socket": self.socket_name, "host": self.host}}

    def reachable(self, peer: Peer) -> bool:
        """Same host as us: worth trying (a different network namespace can still refuse)."""
        info = peer.descriptor.get(self.name)
        return isinstance(info, dict) and info.get("host") == self.host

    # ---- target side ------------------------------------------------------------------
    async def connect(self, peer: Peer) -> None:
        if peer.instance_id not in self._peers:
            mapped = await asyncio.to_thread(self._map_peer, peer)
            with self._lock:
                self._peers[peer.instance_id] = mapped

    async def pull(self, peer: Peer, transfer: PageTransfer) -> None:
        await self.connect(peer)
        mapped = self._peers[peer.instance_id]
        if not mapped.alive():
            self.forget(peer.instance_id)
            raise TransferError(f"{peer.instance_id} is gone")
        src = mapped.layers(transfer)
        dst = self.regions.layers(transfer.kind, transfer.layer_start, transfer.layer_stop)
        args = (src, transfer.src_pages, dst, transfer.dst_pages)
        nbytes = len(transfer.dst_pages) * sum(page_nbytes(layer) for layer in dst)
        try:
            if nbytes <= INLINE_COPY_BYTES:
                copy_pages(*args)
            else:
                await asyncio.to_thread(copy_pages, *args)
        except (RuntimeError, IndexError, ValueError) as exc:
            raise TransferError(f"copy from {peer.instance_id} failed: {exc}") from exc

    def _map_peer(self, peer: Peer) -> PeerRegions:
        info = peer.info(self.name)
        sock, specs, fds = fetch_regions(str(info.get("socket", "")), self.token, MAX_REGIONS)
        try:
            if len(specs) != len(fds):
                raise TransferError("region count and descriptor count differ")
            regions = {}
            for spec, fd in zip(specs, fds, strict=True):
                regions[spec.name] = map_region(fd, os.fstat(fd).st_size, spec.shape, spec.dtype)
        except (OSError, ValueError, RuntimeError, TransferError) as exc:
            sock.close()
            if isinstance(exc, TransferError):
                raise
            raise TransferError(f"cannot map {peer.instance_id}'s caches: {exc!r}") from exc
        finally:
            for fd in fds:
                os.close(fd)  # the mappings keep the memory; the descriptors are not needed
        return PeerRegions(sock, regions)

    def forget(self, instance_id: str) -> None:
        with self._lock:
            mapped = self._peers.pop(instance_id, None)
        if mapped is not None:
            mapped.close()

    # ---- source side ------------------------------------------------------------------
    async def control(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        raise TransferError(f"the shm backend has no control operation {op!r}")

    def _offer(self) -> tuple[dict[str, Any], list[int]]:
        regions = list(self.memory.regions.values())
        return {"regions": [r.header() for r in regions]}, [r.fd for r in regions]

    async def close(self) -> None:
        self._server.close()
        for instance_id in list(self._peers):
            self.forget(instance_id)
