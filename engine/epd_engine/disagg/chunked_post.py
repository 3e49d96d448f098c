"""One HTTP/1.1 POST whose body is written piece by piece, each piece straight to the socket.

``write`` is synchronous: the bytes go to the kernel in the caller's loop iteration, with no
task to wake and no await in between (an HTTP client library's streaming body costs two
more loop iterations per piece, and on an instance each iteration may wait for the GIL
held by the engine thread). h11 does the framing and parses the answer.
"""

from __future__ import annotations

import asyncio

import h11

from epd_engine.api.h11_client import connect, parse_target, read_answer


class ChunkedPost:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._conn = h11.Connection(our_role=h11.CLIENT)
        # the answer may come before the body ends (an error, a router shutting down)
        self.answer: asyncio.Task[tuple[int, bytes]] = asyncio.create_task(self._read_answer())

    @classmethod
    async def open(cls, url: str, headers: dict[str, str], timeout_s: float) -> ChunkedPost:
        target = parse_target(url)
        post = cls(*await connect(target.host, target.port, target.https, timeout_s))
        head = [("Host", target.netloc), ("Transfer-Encoding", "chunked"), *headers.items()]
        request = h11.Request(method="POST", target=target.path, headers=head)
        post._writer.write(post._conn.send(request))
        return post

    @property
    def writable(self) -> bool:
        return self._conn.our_state is h11.SEND_BODY and not self._writer.is_closing()

    def write(self, data: bytes) -> None:
        """Send one piece of the body now (buffered by the transport only if the socket is)."""
        framed = self._conn.send(h11.Data(data=data))
        assert framed is not None
        self._writer.write(framed)

    def end(self) -> None:
        if self.writable:
            framed = self._conn.send(h11.EndOfMessage())
            assert framed is not None
            self._writer.write(framed)

    def close(self) -> None:
        self.answer.cancel()
        self._writer.close()

    async def _read_answer(self) -> tuple[int, bytes]:
        return await read_answer(self._conn, self._reader, "server")
