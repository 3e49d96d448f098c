"""``auto`` backend: a same-host backend with peers on this host, a network one with the rest.

On CPU caches: ``shm`` near, ``tcp`` far. On CUDA caches: ``cuda_ipc`` near, ``nixl`` far
(``tcp`` without NIXL; ``nccl`` only by name). It serves both (its offers describe both),
and per peer it tries the near one when the peer runs on the same kernel; if connecting
fails (pods on one node in separate network namespaces cannot reach each other's abstract
sockets, a GPU not visible here) it remembers that and uses the far one.
"""

from __future__ import annotations

from typing import Any, Protocol

from epd_engine.transfer.backend import PageTransfer, Peer, TransferBackend, TransferError


class NearBackend(TransferBackend, Protocol):
    def reachable(self, peer: Peer) -> bool:
        """Same host as us (worth trying)."""
        ...

    async def connect(self, peer: Peer) -> None:
        """Open what the peer shares; ``TransferError`` when that is impossible."""
        ...


class AutoBackend:
    name = "auto"

    def __init__(self, near: NearBackend, far: TransferBackend) -> None:
        self.near = near
        self.far = far
        self._choice: dict[str, TransferBackend] = {}

    def describe(self) -> dict[str, Any]:
        return {**self.near.describe(), **self.far.describe()}

    def label(self, peer: Peer) -> str:
        """The backend that moves this peer's pages: the one used so far, else the one the
        first pull will try (a pull that moved nothing, every page already here, is still
        counted under the backend it would have used, not under ``auto``)."""
        backend = self._choice.get(peer.instance_id)
        if backend is None:
            backend = self.near if self.near.reachable(peer) else self.far
        return backend.name

    async def pull(self, peer: Peer, transfer: PageTransfer) -> None:
        backend = self._choice.get(peer.instance_id)
        if backend is None:
            backend = self.far
            if self.near.reachable(peer):
                try:
                    await self.near.connect(peer)
                    backend = self.near
                except TransferError:
                    pass  # same kernel, other namespace or GPU: fall back for good
            self._choice[peer.instance_id] = backend
        await backend.pull(peer, transfer)

    async def control(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        """The far backend's (nccl: a peer asks us to join a group); near ones have none."""
        return await self.far.control(op, body)

    def forget(self, instance_id: str) -> None:
        self._choice.pop(instance_id, None)
        self.near.forget(instance_id)
        self.far.forget(instance_id)

    async def close(self) -> None:
        await self.near.close()
        await self.far.close()
