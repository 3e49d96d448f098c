"""``shm`` backend: same host, CPU. Caches live in memfd regions (``memory.SharedMemory``);
a peer maps the source's regions once, and a transfer is a direct page copy between the
two mappings -- one memcpy per run of pages, no socket, no source-side work.

Connect: the target opens the source's abstract Unix socket (named in the offer), proves
the internal token, and receives the regions' file descriptors (SCM_RIGHTS) with a JSON
header of names, shapes and dtypes. It is the CPU twin of CUDA IPC: handles exchanged
once per peer, then copies between the two processes' memory. The socket stays open:
when the source dies the target sees EOF, drops the mapping, and the pull fails cleanly.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from epd_engine.request import CacheKind
from epd_engine.transfer.backend import CacheRegions, PageTransfer, Peer, TransferError
from epd_engine.transfer.memory import SharedMemory, dtype_of, map_region
from epd_engine.transfer.pages import copy_pages, page_nbytes
from epd_engine.transfer.peer_socket import (
    LineReader,
    check_token,
    peer_closed,
    recv_json,
    send_json,
)

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 5.0
# A copy this small takes less time (tens of microseconds) than the hop to a worker thread
# and back (~0.2 ms): do it on the event loop.
INLINE_COPY_BYTES = 1 << 20


def host_id() -> str:
    """Same kernel, same id: shared memory is possible only between such processes."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


@dataclass
class _Mapped:
    sock: socket.socket  # kept open: EOF means the source is gone
    regions: dict[str, torch.Tensor]

    def layers(self, transfer: PageTransfer) -> list[torch.Tensor]:
        if transfer.kind is CacheKind.IMAGE:
            names = ["image"]
        else:
            names = [f"kv.{i}" for i in range(transfer.layer_start, transfer.layer_stop)]
        try:
            return [self.regions[name] for name in names]
        except KeyError as exc:
            raise TransferError(f"the source has no cache region {exc}") from None


class ShmBackend:
    name = "shm"

    def __init__(self, memory: SharedMemory, regions: CacheRegions, token: str) -> None:
        self.memory = memory
        self.regions = regions
        self.token = token
        self.socket_name = f"epd-shm-{uuid.uuid4().hex}"
        self.host = host_id()
        self._peers: dict[str, _Mapped] = {}
        self._lock = threading.Lock()
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind("\0" + self.socket_name)  # abstract: nothing on disk to clean up
        self._server.listen(16)
        self._closed = False
        threading.Thread(target=self._accept, name="epd-shm-server", daemon=True).start()

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
        if peer_closed(mapped.sock):
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

    def _map_peer(self, peer: Peer) -> _Mapped:
        info = peer.info(self.name)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(CONNECT_TIMEOUT_S)
        fds: list[int] = []
        try:
            sock.connect("\0" + str(info.get("socket", "")))
            send_json(sock, {"token": self.token})
            message, fds, _, _ = socket.recv_fds(sock, 1 << 16, 256)
            header = recv_json(LineReader(sock, message))
            if "error" in header:
                raise TransferError(f"{peer.instance_id} refused: {header['error']}")
            specs = header.get("regions", [])
            if len(specs) != len(fds):
                raise TransferError("region count and descriptor count differ")
            regions = {}
            for spec, fd in zip(specs, fds, strict=True):
                shape = tuple(int(x) for x in spec["shape"])
                dtype = dtype_of(str(spec["dtype"]))
                nbytes = os.fstat(fd).st_size
                regions[str(spec["name"])] = map_region(fd, nbytes, shape, dtype)
        except (OSError, KeyError, TypeError, ValueError) as exc:
            sock.close()
            raise TransferError(f"cannot map {peer.instance_id}'s caches: {exc!r}") from exc
        except TransferError:
            sock.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)  # the mappings keep the memory; the descriptors are not needed
        sock.settimeout(None)
        return _Mapped(sock, regions)

    def forget(self, instance_id: str) -> None:
        with self._lock:
            mapped = self._peers.pop(instance_id, None)
        if mapped is not None:
            mapped.sock.close()  # the mapping goes with the last tensor that views it

    # ---- source side ------------------------------------------------------------------
    async def control(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        raise TransferError(f"the shm backend has no control operation {op!r}")

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        """Hand our regions to a peer that knows the token, then wait for it to hang up."""
        with conn:
            conn.settimeout(CONNECT_TIMEOUT_S)
            try:
                hello = recv_json(LineReader(conn))
                if not check_token(hello.get("token"), self.token):
                    send_json(conn, {"error": "wrong internal token"})
                    return
                regions = list(self.memory.regions.values())
                header = {"regions": [r.header() for r in regions]}
                payload = (json.dumps(header) + "\n").encode()
                socket.send_fds(conn, [payload], [r.fd for r in regions])
                conn.settimeout(None)
                while conn.recv(1 << 12):  # held open for liveness; returns on EOF
                    pass
            except (OSError, TransferError) as exc:
                log.debug("shm peer connection ended: %r", exc)

    async def close(self) -> None:
        self._closed = True
        self._server.close()
        for instance_id in list(self._peers):
            self.forget(instance_id)
