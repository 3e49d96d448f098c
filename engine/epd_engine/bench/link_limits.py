"""The physical limit each backend is divided by, measured on the same bytes in the same run.

Each limit moves a list of message sizes (one per transfer the backend makes: a layer
group, an image, a page) into distinct regions of one preallocated destination, so cache
effects match the backend's, and blocks until the bytes have landed:

- ``Memcpy`` (for ``shm``): ``copy_`` between two contiguous tensors in this process;
- ``RawSocket`` (for ``tcp``): the ``link_peer`` process sends the bytes over one persistent
  loopback connection (a JSON request line each), received straight into the destination;
- ``RawGloo`` (for ``collective``): the ``link_peer`` process sends one contiguous tensor
  per message over a two-rank gloo group (a JSON request line per list of messages, over a
  raw socket), received with gloo's own ``recv``.
"""

from __future__ import annotations

import socket
import threading
import uuid
from collections.abc import Sequence
from typing import Protocol

import torch

from epd_engine.bench.link_peer import TIMEOUT_S, read_line, send_line
from epd_engine.transfer.communicator import Communicator, GlooPair, rendezvous_store


class Limit(Protocol):
    name: str

    def run(self, sizes: Sequence[int]) -> None:
        """Move messages of these byte sizes, one after another; return when all landed."""
        ...

    def close(self) -> None: ...


def _regions(buffer: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return [buffer[o : o + n] for o, n in zip(offsets, sizes, strict=True)]


def _touched(nbytes: int) -> torch.Tensor:
    """A buffer whose pages are already mapped: page faults are not the link's cost."""
    return torch.ones(nbytes, dtype=torch.uint8)


class Memcpy:
    name = "memcpy"

    def __init__(self, max_bytes: int) -> None:
        self.src = _touched(max_bytes)
        self.dst = _touched(max_bytes)

    def run(self, sizes: Sequence[int]) -> None:
        for src, dst in zip(_regions(self.src, sizes), _regions(self.dst, sizes), strict=True):
            dst.copy_(src)

    def close(self) -> None:
        pass


class RawSocket:
    name = "raw_socket"

    def __init__(self, port: int, max_bytes: int) -> None:
        self.sock: socket.socket = socket.create_connection(("127.0.0.1", port), TIMEOUT_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.dst = _touched(max_bytes)

    def run(self, sizes: Sequence[int]) -> None:
        for region in _regions(self.dst, sizes):
            send_line(self.sock, {"op": "bytes", "nbytes": region.numel()})
            view = memoryview(region.numpy())  # type: ignore[arg-type]
            filled = 0
            while filled < len(view):
                n = self.sock.recv_into(view[filled:])
                if n == 0:
                    raise ConnectionError("link peer closed the connection")
                filled += n

    def close(self) -> None:
        self.sock.close()


class RawGloo:
    name = "raw_gloo"

    def __init__(self, port: int, max_bytes: int) -> None:
        self.sock: socket.socket = socket.create_connection(("127.0.0.1", port), TIMEOUT_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.dst = _touched(max_bytes)
        self.group = self._form()
        self.tag = 0

    def _form(self) -> Communicator:
        """Host the rendezvous and join as rank 1 while the peer joins as rank 0."""
        key = uuid.uuid4().hex
        store = rendezvous_store("127.0.0.1", 0, True, TIMEOUT_S)
        formed: list[Communicator] = []
        thread = threading.Thread(
            target=lambda: formed.append(GlooPair(store, key, 1, "127.0.0.1", TIMEOUT_S))
        )
        thread.start()
        send_line(self.sock, {"op": "join", "key": key, "host": "127.0.0.1", "port": store.port})
        with self.sock.makefile("rb") as lines:  # one answer; gloo carries the rest
            answer = read_line(lines)
        thread.join(TIMEOUT_S)
        if answer.get("status") != "joined" or not formed:
            raise RuntimeError(f"the link peer did not join a gloo group: {answer}")
        return formed[0]

    def run(self, sizes: Sequence[int]) -> None:
        tag = self.tag
        self.tag += len(sizes)
        send_line(self.sock, {"op": "gloo", "sizes": list(sizes), "tag": tag})
        for i, region in enumerate(_regions(self.dst, sizes)):
            self.group.recv(region, tag + i)

    def close(self) -> None:
        self.group.close()
        self.sock.close()


def limit_for(backend: str, link_port: int, max_bytes: int) -> Limit:
    """The physical limit of ``backend`` (shm and nixl on one host: memcpy, tcp: raw
    socket, collective: gloo)."""
    if backend in ("shm", "nixl"):
        return Memcpy(max_bytes)
    if backend == "tcp":
        return RawSocket(link_port, max_bytes)
    if backend == "collective":
        return RawGloo(link_port, max_bytes)
    raise ValueError(f"no physical limit defined for backend {backend!r}")
