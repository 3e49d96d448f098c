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
READY_PATH = "/health/ready"
PROBE_EVERY_S = 0.25
PROBE_TIMEOUT_S = 1.0  # a replica that does not answer in time (frozen, swamped) is not ready


class TcpBalancer:
    def __init__(
        self,
        host: str,
        port: int,
        backends: Sequence[tuple[str, int]],
        ready_path: str | None = READY_PATH,
    ) -> None:
        """``ready_path``: the backends' readiness probe (None: every backend is ready)."""
        if not backends:
            raise ValueError("a balancer needs at least one backend")
        self.host = host
        self.port = port
        self.backends = list(backends)
        self.ready_path = ready_path
        self.num_connections = [0] * len(self.backends)  # per backend, for tests and logs
        self.ready = [ready_path is None] * len(self.backends)  # per backend: its last probe
        self._next = itertools.cycle(range(len(self.backends)))
        self._server: asyncio.Server | None = None
        self._prober: asyncio.Task[None] | None = None
        self._open: set[asyncio.StreamWriter] = set()  # both ends of every open connection
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    async def open(self) -> None:
        """Listen on the caller's event loop, the backends probed once first."""
        if self.ready_path is not None:
            await self._probe_all()
            self._prober = asyncio.create_task(self._probe_forever())
        self._server = await asyncio.start_server(self._handle, self.host, self.port)

    async def close(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            self._prober = None
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in self._open:  # the server's close leaves open connections open
            writer.transport.abort()

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
        self._open |= {writer, up_writer}
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            self._open -= {writer, up_writer}
            writer.close()
            up_writer.close()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        first, num = next(self._next), len(self.backends)
        turn = [(first + k) % num for k in range(num)]
        ready = [i for i in turn if self.ready[i]]
        for index in [*ready, *(i for i in turn if i not in ready)]:
            host, port = self.backends[index]
            try:
                upstream = await asyncio.open_connection(host, port)
            except OSError as exc:
                log.warning("balancer: %s:%d refused: %r", host, port, exc)
                continue
            self.num_connections[index] += 1
            return upstream
        return None

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(PROBE_EVERY_S)
            await self._probe_all()

    async def _probe_all(self) -> None:
        assert self.ready_path is not None
        found = await asyncio.gather(
            *(_probe(host, port, self.ready_path) for host, port in self.backends)
        )
        for index, (was, now) in enumerate(zip(self.ready, found, strict=True)):
            if was != now:
                host, port = self.backends[index]
                log.warning("balancer: %s:%d %s", host, port, "ready" if now else "not ready")
        self.ready = list(found)


async def _probe(host: str, port: int, path: str) -> bool:
    """Whether ``GET path`` answers 200 within the probe timeout."""
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                head = f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n"
                writer.write(head.encode())
                status_line = await reader.readline()
            finally:
                writer.close()
    except (OSError, TimeoutError):
        return False
    return status_line.split(b" ")[1:2] == [b"200"]


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
