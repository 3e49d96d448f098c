"""``tcp`` backend: any host. Raw page bytes over a persistent socket per peer.

The source runs a small threaded server next to its HTTP port. A target connects once
(a JSON hello with the internal token) and keeps the connection. Per transfer it sends a
JSON header line naming the request, kind, source pages and layers; the source checks
them against what that request exposes and answers a JSON line ``{"nbytes": N}`` followed
by N raw bytes: for each layer, each run of consecutive source pages straight from its
cache tensor. The target reads those bytes straight into its destination pages
(``recv_into`` on a view of the page memory): no container format, no staging copy on CPU.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import socketserver
import threading
from collections import defaultdict
from typing import Any

import torch

from epd_engine.transfer.backend import (
    CacheRegions,
    Exports,
    PageTransfer,
    Peer,
    TransferError,
    requested_layers,
)
from epd_engine.transfer.pages import byte_view, page_nbytes, page_runs
from epd_engine.transfer.peer_socket import LineReader, check_token, recv_json, send_json

log = logging.getLogger(__name__)


class TcpBackend:
    name = "tcp"

    def __init__(
        self,
        regions: CacheRegions,
        exports: Exports,
        token: str,
        bind_host: str = "127.0.0.1",
        advertise_host: str = "127.0.0.1",
        port: int = 0,
        timeout_s: float = 30.0,
    ) -> None:
        self.regions = regions
        self.exports = exports
        self.token = token
        self.timeout_s = timeout_s
        self._server = _PageServer((bind_host, port), self)
        self.advertise = (advertise_host, self._server.server_address[1])
        self._idle: dict[str, list[tuple[socket.socket, LineReader]]] = defaultdict(list)
        self._lock = threading.Lock()
        threading.Thread(
            target=self._server.serve_forever, name="epd-tcp-pages", daemon=True
        ).start()

    def describe(self) -> dict[str, Any]:
        host, port = self.advertise
        return {self.name: {"host": host, "port": port}}

    # ---- target side ------------------------------------------------------------------
    async def pull(self, peer: Peer, transfer: PageTransfer) -> None:
        dst = self.regions.layers(transfer.kind, transfer.layer_start, transfer.layer_stop)
        await asyncio.to_thread(self._pull_blocking, peer, transfer, dst)

    def _pull_blocking(self, peer: Peer, transfer: PageTransfer, dst: list[torch.Tensor]) -> None:
        sock, reader = self._connection(peer)
        try:
            send_json(sock, transfer.to_json())
            answer = recv_json(reader)
            if "error" in answer:
                raise TransferError(f"{peer.instance_id} refused: {answer['error']}")
            expected = sum(page_nbytes(layer) * len(transfer.dst_pages) for layer in dst)
            if answer.get("nbytes") != expected:
                raise TransferError(f"{peer.instance_id} sends {answer.get('nbytes')} bytes, "
                                    f"{expected} expected")  # fmt: skip
            for layer in dst:
                for start, stop in page_runs(transfer.dst_pages):
                    _receive_run(reader, layer, start, stop)
        except TransferError:
            sock.close()
            raise
        except OSError as exc:  # reset, timeout: the source died or stalled
            sock.close()
            raise TransferError(f"pull from {peer.instance_id} failed: {exc!r}") from exc
        with self._lock:
            self._idle[peer.instance_id].append((sock, reader))

    def _connection(self, peer: Peer) -> tuple[socket.socket, LineReader]:
        with self._lock:
            if self._idle[peer.instance_id]:
                return self._idle[peer.instance_id].pop()
        info = peer.info(self.name)
        try:
            sock = socket.create_connection(
                (str(info["host"]), int(info["port"])), timeout=self.timeout_s
            )
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            send_json(sock, {"token": self.token})
        except (OSError, KeyError, ValueError) as exc:
            raise TransferError(f"cannot connect to {peer.instance_id}: {exc!r}") from exc
        return sock, LineReader(sock)

    def forget(self, instance_id: str) -> None:
        with self._lock:
            connections = self._idle.pop(instance_id, [])
        for sock, _ in connections:
            sock.close()

    # ---- source side ------------------------------------------------------------------
    async def control(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        raise TransferError(f"the tcp backend has no control operation {op!r}")

    def serve_connection(self, sock: socket.socket) -> None:
        """One peer's connection: a token hello, then transfers until it hangs up."""
        sock.settimeout(self.timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = LineReader(sock)
        if not check_token(recv_json(reader).get("token"), self.token):
            send_json(sock, {"error": "wrong internal token"})
            return
        sock.settimeout(None)  # idle between transfers is fine; the peer closes when done
        while True:
            try:
                header = recv_json(reader)
            except TransferError:
                return  # the peer hung up
            try:
                layers, pages = self._resolve(header)
            except (TransferError, KeyError, TypeError, ValueError) as exc:
                send_json(sock, {"error": str(exc)})
                continue
            send_json(sock, {"nbytes": sum(page_nbytes(layer) * len(pages) for layer in layers)})
            for layer in layers:
                for start, stop in page_runs(pages):
                    sock.sendall(_readable(layer, start, stop))

    def _resolve(self, header: dict[str, Any]) -> tuple[list[torch.Tensor], list[int]]:
        return requested_layers(header, self.exports, self.regions)

    async def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        for instance_id in list(self._idle):
            self.forget(instance_id)


def _receive_run(reader: LineReader, layer: torch.Tensor, start: int, stop: int) -> None:
    if layer.device.type == "cpu":  # straight into the destination pages
        reader.read_into(byte_view(layer, start, stop))
        return
    # GPU pages (not verified here, no device): one host buffer, one host-to-device copy
    staging = torch.empty((stop - start, *layer.shape[1:]), dtype=layer.dtype)
    reader.read_into(byte_view(staging, 0, stop - start))
    layer[start:stop].copy_(staging)


def _readable(layer: torch.Tensor, start: int, stop: int) -> memoryview:
    if layer.device.type != "cpu":  # one device-to-host copy of the run
        return byte_view(layer[start:stop].cpu(), 0, stop - start)
    return byte_view(layer, start, stop)


class _PageServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], backend: TcpBackend) -> None:
        self.backend = backend
        super().__init__(address, _Handler)


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        server: _PageServer = self.server  # type: ignore[assignment]
        try:
            server.backend.serve_connection(self.request)
        except (OSError, TransferError) as exc:
            log.debug("page connection ended: %r", exc)
