"""The source side of the physical limits ``bench-transfer`` divides by: a process that sends
raw bytes over a loopback socket, or contiguous tensors over gloo, as fast as they go.

``python -m epd_engine.bench.link_peer --port P`` listens on 127.0.0.1:P. A client sends
JSON lines on one persistent connection:

- ``{"op": "bytes", "nbytes": N}``: N raw bytes come back on the same socket (one
  ``sendall`` from a preallocated buffer: the raw socket limit of the tcp backend);
- ``{"op": "join", "key", "host", "port"}``: form a two-rank gloo group (the client hosts the
  rendezvous store, as the collective backend's target does); answers ``{"status": "joined"}``;
- ``{"op": "gloo", "sizes": [...], "tag": T}``: send one contiguous uint8 tensor of each
  size over that group, tags T, T+1, ... (gloo's own send/recv: the collective limit).

Nothing here checks pages, tokens or exports: it is the floor a backend is measured against.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import threading
import time
from typing import Any, BinaryIO

import torch

from epd_engine.transfer.communicator import Communicator, GlooPair, rendezvous_store

TIMEOUT_S = 60.0


def send_line(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def read_line(lines: BinaryIO) -> dict[str, Any]:
    """The next JSON line (``lines``: the socket's ``makefile("rb")``); EOFError at the end."""
    line = lines.readline()
    if not line:
        raise EOFError("the other end hung up")
    message: dict[str, Any] = json.loads(line)
    return message


class _Buffer:
    """One send buffer, grown on demand (contents do not matter, only the bytes' count)."""

    def __init__(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)

    def view(self, nbytes: int) -> torch.Tensor:
        if self.tensor.numel() < nbytes:
            self.tensor = torch.ones(nbytes, dtype=torch.uint8)  # touched: no faults when timed
        return self.tensor[:nbytes]


def serve(conn: socket.socket) -> None:
    """One client's connection, until it hangs up."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    lines = conn.makefile("rb")  # only requests arrive here: buffered reads lose nothing
    buffer = _Buffer()
    group: Communicator | None = None
    try:
        while True:
            message = read_line(lines)
            op = message.get("op")
            if op == "bytes":
                conn.sendall(memoryview(buffer.view(int(message["nbytes"])).numpy()))  # type: ignore[arg-type]
            elif op == "join":
                store = rendezvous_store(str(message["host"]), int(message["port"]), False,
                                         TIMEOUT_S)  # fmt: skip
                group = GlooPair(store, str(message["key"]), 0, "127.0.0.1", TIMEOUT_S)
                send_line(conn, {"status": "joined"})
            elif op == "gloo" and group is not None:
                sizes = [int(n) for n in message["sizes"]]
                for i, nbytes in enumerate(sizes):
                    group.send(buffer.view(nbytes), int(message["tag"]) + i)
            else:
                send_line(conn, {"error": f"unknown op {op!r} (or no group yet)"})
    except Exception:  # the client hung up (or broke the protocol): this connection ends
        return
    finally:
        conn.close()
        if group is not None:
            group.close()


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    server = socket.create_server(("127.0.0.1", args.port))
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    while True:
        conn, _ = server.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main()
