"""``auto`` backend: shared memory with peers on the same host, tcp with the rest.

It serves both (its offers describe both), and per peer it tries ``shm`` when the peer
runs on the same kernel; if mapping fails (pods on one node in separate network
namespaces cannot reach each other's abstract sockets) it remembers that and uses ``tcp``.
On GPUs the same rule will pick ``cuda_ipc`` and ``nccl``.
"""

from __future__ import annotations

from typing import Any

from epd_engine.transfer.backend import PageTransfer, Peer, TransferError
from epd_engine.transfer.shm import ShmBackend
from epd_engine.transfer.tcp import TcpBackend


class AutoBackend:
    name = "auto"

    def __init__(self, shm: ShmBackend, tcp: TcpBackend) -> None:
        self.shm = shm
        self.tcp = tcp
        self._choice: dict[str, ShmBackend | TcpBackend] = {}

    def describe(self) -> dict[str, Any]:
        return {**self.shm.describe(), **self.tcp.describe()}

    def chosen(self, instance_id: str) -> str | None:
        """The backend used with this peer so far (None before the first pull)."""
        backend = self._choice.get(instance_id)
        return backend.name if backend is not None else None

    async def pull(self, peer: Peer, transfer: PageTransfer) -> None:
        backend = self._choice.get(peer.instance_id)
        if backend is None:
            backend = self.tcp
            if self.shm.reachable(peer):
                try:
                    await self.shm.connect(peer)
                    backend = self.shm
                except TransferError:
                    pass  # same kernel, other namespace: fall back for good
            self._choice[peer.instance_id] = backend
        await backend.pull(peer, transfer)

    async def control(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        raise TransferError(f"the auto backend has no control operation {op!r}")

    def forget(self, instance_id: str) -> None:
        self._choice.pop(instance_id, None)
        self.shm.forget(instance_id)
        self.tcp.forget(instance_id)

    async def close(self) -> None:
        await self.shm.close()
        await self.tcp.close()
