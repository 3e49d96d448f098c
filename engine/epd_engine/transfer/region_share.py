"""Handle exchange shared by the same-host backends (``shm`` on CPU, ``cuda_ipc`` on GPUs).

A source serves its cache regions on an abstract Unix socket named in its offer. A target
connects once per peer, proves the internal token and receives one JSON header line
``{"regions": [{"name", "shape", "dtype", ...backend fields}]}`` -- with the regions' file
descriptors (SCM_RIGHTS) for ``shm``, with CUDA IPC handles inside the header for
``cuda_ipc``. Never pickle. The socket then stays open for liveness: when the source dies
the target sees EOF, drops what it opened, and its next pull fails cleanly.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from epd_engine.request import CacheKind
from epd_engine.transfer.backend import PageTransfer, TransferError
from epd_engine.transfer.memory import dtype_name, dtype_of
from epd_engine.transfer.peer_socket import (
    LineReader,
    check_token,
    peer_closed,
    recv_json,
    send_json,
)

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 5.0
MAX_REGIONS = 1024
# What the source hands one peer: the header and the descriptors to pass along (maybe none).
Offer = Callable[[], tuple[dict[str, Any], list[int]]]


def region_header(name: str, tensor: torch.Tensor, **extra: Any) -> dict[str, Any]:
    """One region's entry in the header (plain JSON)."""
    return {"name": name, "shape": list(tensor.shape), "dtype": dtype_name(tensor.dtype), **extra}


@dataclass(frozen=True)
class RegionSpec:
    """One region as a peer's header described it, validated."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    extra: dict[str, Any] = field(default_factory=dict)  # the backend's own fields


def parse_regions(header: dict[str, Any]) -> list[RegionSpec]:
    """The header's regions; ``TransferError`` naming what is wrong with a malformed one."""
    if "error" in header:
        raise TransferError(f"refused: {header['error']}")
    regions = header.get("regions")
    if not isinstance(regions, list) or len(regions) > MAX_REGIONS:
        raise TransferError("the peer's header has no list of regions")
    specs = []
    for i, region in enumerate(regions):
        try:
            if not isinstance(region, dict):
                raise TypeError("not an object")
            name, shape, dtype = region["name"], region["shape"], region["dtype"]
            if not isinstance(name, str) or not isinstance(shape, list):
                raise TypeError("name must be a string and shape a list")
            if not all(isinstance(x, int) and x >= 0 for x in shape):
                raise ValueError(f"bad shape {shape}")
            extra = {k: v for k, v in region.items() if k not in ("name", "shape", "dtype")}
            specs.append(RegionSpec(name, tuple(shape), dtype_of(str(dtype)), extra))
        except (KeyError, TypeError, ValueError) as exc:
            raise TransferError(f"malformed region {i} in the peer's header: {exc!r}") from None
    return specs


class RegionServer:
    """Source side: hands ``offer()`` to each peer that knows the token, then holds the
    connection open until the peer hangs up (its liveness signal)."""

    def __init__(self, prefix: str, token: str, offer: Offer) -> None:
        self.token = token
        self.offer = offer
        self.socket_name = f"{prefix}-{uuid.uuid4().hex}"
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind("\0" + self.socket_name)  # abstract: nothing on disk to clean up
        self._server.listen(16)
        self._closed = False
        threading.Thread(target=self._accept, name=f"{prefix}-server", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(CONNECT_TIMEOUT_S)
            try:
                hello = recv_json(LineReader(conn))
                if not check_token(hello.get("token"), self.token):
                    send_json(conn, {"error": "wrong internal token"})
                    return
                try:
                    header, fds = self.offer()
                except (RuntimeError, ValueError) as exc:  # e.g. a storage CUDA cannot export
                    log.warning("%s cannot offer its regions: %r", self.socket_name, exc)
                    send_json(conn, {"error": f"cannot export the caches: {exc}"})
                    return
                payload = (json.dumps(header) + "\n").encode()
                if fds:
                    socket.send_fds(conn, [payload], fds)
                else:
                    conn.sendall(payload)
                conn.settimeout(None)
                while conn.recv(1 << 12):  # held open for liveness; returns on EOF
                    pass
            except (OSError, RuntimeError, TransferError) as exc:
                log.debug("%s peer connection ended: %r", self.socket_name, exc)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):  # wakes the accept thread (close alone does not)
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()


def fetch_regions(
    socket_name: str, token: str, max_fds: int = 0
) -> tuple[socket.socket, list[RegionSpec], list[int]]:
    """Target side: connect, prove the token, receive the header (and descriptors). The
    caller owns the socket (keep it for liveness) and must close the descriptors."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(CONNECT_TIMEOUT_S)
    fds: list[int] = []
    try:
        sock.connect("\0" + socket_name)
        send_json(sock, {"token": token})
        message, fds, _, _ = socket.recv_fds(sock, 1 << 16, max(1, max_fds))
        specs = parse_regions(recv_json(LineReader(sock, message)))
    except (OSError, TransferError) as exc:
        sock.close()
        for fd in fds:
            os.close(fd)
        if isinstance(exc, TransferError):
            raise
        raise TransferError(f"cannot reach {socket_name}: {exc!r}") from exc
    sock.settimeout(None)
    return sock, specs, list(fds)


@dataclass
class PeerRegions:
    """Target side: a source's regions as tensors here, and the socket that says it lives."""

    sock: socket.socket
    regions: dict[str, torch.Tensor]

    def alive(self) -> bool:
        return not peer_closed(self.sock)

    def layers(self, transfer: PageTransfer) -> list[torch.Tensor]:
        if transfer.kind is CacheKind.IMAGE:
            names = ["image"]
        else:
            names = [f"kv.{i}" for i in range(transfer.layer_start, transfer.layer_stop)]
        try:
            return [self.regions[name] for name in names]
        except KeyError as exc:
            raise TransferError(f"the source has no cache region {exc}") from None

    def close(self) -> None:
        self.sock.close()  # the opened memory goes with the last tensor that views it
