"""A per-connection TCP balancer: what a Kubernetes Service does for a local run.

``epdctl up`` with ``router.replicas`` above one puts this in front of the router processes
on the run's one port: each new connection goes to the next replica in turn, and every byte
of it to that replica only, as kube-proxy spreads connections over a Service's pods. A
replica that refuses the connection (down, restarting) is skipped for the next one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Sequence

log = logging.getLogger(__name__)

CHUNK_BYTES = 65536


class TcpBalancer:
    def __init__(self, host: str, port: int, backends: Sequence[tuple[str, int]]) -> None:
        if not backends:
            raise ValueError("a balancer needs at least one backend")
        self.host = host
        self.port = port
        self.backends = list(backends)
        self.num_connections = [0] * len(self.backends)  # per backend, for tests and logs
        self._next = itertools.cycle(range(len(self.backends)))
        self._server: asyncio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    async def open(self) -> None:
        """Listen on the caller's event loop."""
        self._server = await asyncio.start_server(self._handle, self.host, self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def start_in_thread(self) -> None:
        """Listen on a loop of its own, in a daemon thread (a supervisor's sync loop)."""
        started = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self.open())
            except OSError as exc:  # the port is taken: the caller says so
                failed.append(exc)
                started.set()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(self.close())
            loop.close()

        self._thread = threading.Thread(target=run, name="epd-tcp-balancer", daemon=True)
        self._thread.start()
        started.wait()
        if failed:
            raise failed[0]

    def stop_thread(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream = await self._connect()
        if upstream is None:
            writer.transport.abort()
            return
        up_reader, up_writer = upstream
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            writer.close()
            up_writer.close()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        for _ in self.backends:
            index = next(self._next)
            host, port = self.backends[index]
            try:
                upstream = await asyncio.open_connection(host, port)
            except OSError as exc:
                log.warning("balancer: %s:%d refused: %r", host, port, exc)
                continue
            self.num_connections[index] += 1
            return upstream
        return None


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One direction. Its end is passed on as a half-close (the other side may still
    answer); a reset ends both directions."""
    try:
        while data := await reader.read(CHUNK_BYTES):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.transport.abort()
