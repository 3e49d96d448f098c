"""The transfer seam: how a migration target fills its cache pages from a source's.

Control (the four migration steps) is plain JSON over HTTP and lives in
``disagg/`` (``source.py`` offers, ``target.py`` pulls, ``peers.py`` chooses); a backend
moves page contents only. Its contract:

- **Connect once per peer.** Every instance publishes ``describe()`` (addresses, a socket
  name, later IPC handles or a communicator's rendezvous) inside each migration offer it
  sends. A target connects to a source lazily on its first pull and keeps the connection
  (mapped memory, sockets, a communicator group) until ``forget`` or ``close``.
- **A transfer names pages, not payloads.** ``PageTransfer`` says which source pages go
  into which destination pages, for which layers; the backend writes straight into the
  target's own cache tensors. Nothing is re-serialised into a container format.
- **Asynchronous, off the event loop.** ``pull`` is awaited on the event loop but every
  byte is copied in a worker thread (or by the backend's own threads), so heartbeats and
  token events keep flowing during a transfer.
- **Failures raise ``TransferError``** (peer gone, refused, timed out, malformed). The
  caller then recomputes or re-routes; a backend never leaves a pull hanging, and a dead
  peer leaves no mapping or connection behind on the next ``forget``.
- **No pickle.** Headers and control messages are JSON; data is raw page bytes.

Sources answer only for pages they exported (``Exports``): a peer holding the internal
token still cannot read pages that belong to no migrating request.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from epd_engine.request import CacheKind


class TransferError(RuntimeError):
    pass


@dataclass(frozen=True)
class PageTransfer:
    """Copy ``src_pages`` of the source's ``kind`` cache into our ``dst_pages``, for layers
    ``[layer_start, layer_stop)`` (the image cache has one layer)."""

    request_id: str
    kind: CacheKind
    src_pages: tuple[int, ...]
    dst_pages: tuple[int, ...]
    layer_start: int = 0
    layer_stop: int = 1

    def __post_init__(self) -> None:
        if len(self.src_pages) != len(self.dst_pages):
            raise ValueError("a transfer needs as many destination pages as source pages")
        if not 0 <= self.layer_start < self.layer_stop:
            raise ValueError(f"bad layer range [{self.layer_start}, {self.layer_stop})")

    def to_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "kind": self.kind.value,
            "src_pages": list(self.src_pages),
            "layers": [self.layer_start, self.layer_stop],
        }


@dataclass(frozen=True)
class Peer:
    """A migration source as its offer described it."""

    instance_id: str
    url: str  # its HTTP control plane
    descriptor: dict[str, Any]  # backend name -> what that backend needs to connect

    def info(self, backend: str) -> dict[str, Any]:
        info = self.descriptor.get(backend)
        if not isinstance(info, dict):
            raise TransferError(f"{self.instance_id} does not serve the {backend} backend")
        return info


@dataclass
class CacheRegions:
    """This instance's cache tensors as backends see them: pages along the first dim."""

    kv: list[torch.Tensor] = field(default_factory=list)  # [num_blocks, 2, bs, Hkv, D] each
    image: torch.Tensor | None = None  # [num_image_blocks, tokens_per_page, H]

    def layers(self, kind: CacheKind, start: int = 0, stop: int = 1) -> list[torch.Tensor]:
        if kind is CacheKind.IMAGE:
            if self.image is None:
                raise TransferError("this instance has no image cache")
            if (start, stop) != (0, 1):
                raise TransferError("the image cache has one layer")
            return [self.image]
        if not 0 <= start < stop <= len(self.kv):
            raise TransferError(f"layers [{start}, {stop}) outside 0..{len(self.kv)}")
        return self.kv[start:stop]


class Exports:
    """Source side: the pages each migrating request exposes until its release (thread-safe:
    backends serve pulls from their own threads)."""

    def __init__(self) -> None:
        self._pages: dict[tuple[str, CacheKind], frozenset[int]] = {}
        self._lock = threading.Lock()

    def expose(self, request_id: str, kind: CacheKind, pages: Sequence[int]) -> None:
        with self._lock:
            self._pages[(request_id, kind)] = frozenset(pages)

    def withdraw(self, request_id: str) -> None:
        with self._lock:
            for kind in CacheKind:
                self._pages.pop((request_id, kind), None)

    def check(self, request_id: str, kind: CacheKind, pages: Sequence[int]) -> None:
        """Raise ``TransferError`` unless every page was exposed for this request."""
        with self._lock:
            exposed = self._pages.get((request_id, kind))
        if exposed is None:
            raise TransferError(f"no migrating request {request_id} with {kind.value} pages")
        if not exposed.issuperset(pages):
            raise TransferError(f"pages outside what {request_id} exposes were asked for")


def requested_layers(
    header: dict[str, Any], exports: Exports, regions: CacheRegions
) -> tuple[list[torch.Tensor], list[int]]:
    """Source side: the cache layers and source pages a peer's transfer header
    (``PageTransfer.to_json``) asks for, once checked against what the request exposes."""
    try:
        request_id = str(header["request_id"])
        kind = CacheKind(header["kind"])
        pages = [int(p) for p in header["src_pages"]]
        start, stop = (int(x) for x in header["layers"])
    except (KeyError, TypeError, ValueError) as exc:
        raise TransferError(f"malformed transfer header: {exc!r}") from exc
    exports.check(request_id, kind, pages)
    return regions.layers(kind, start, stop), pages


class TransferBackend(Protocol):
    """Moves page contents between instances (contract in the module docstring)."""

    name: str

    def describe(self) -> dict[str, Any]:
        """``{backend name: connection info}`` peers need to pull from us (JSON)."""
        ...

    async def pull(self, peer: Peer, transfer: PageTransfer) -> None:
        """Target side: fill our ``dst_pages`` from the peer; ``TransferError`` on failure."""
        ...

    async def control(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        """Source side: a peer's control message for this backend (``POST
        /internal/transfer/{backend}/{op}``); backends without one raise ``TransferError``."""
        ...

    def forget(self, instance_id: str) -> None:
        """Drop what we hold for a peer (it left the deployment or failed)."""
        ...

    async def close(self) -> None: ...
