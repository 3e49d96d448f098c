"""One HTTP/1.1 POST whose body is written piece by piece, each piece straight to the socket.

``write`` is synchronous: the bytes go to the kernel in the caller's loop iteration, with no
task to wake and no await in between (an HTTP client library's streaming body costs two
more loop iterations per piece, and on an instance each iteration may wait for the GIL
held by the engine thread). h11 does the framing and parses the answer.
"""

from __future__ import annotations

import asyncio
import ssl
from urllib.parse import urlsplit

import h11


class ChunkedPost:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._conn = h11.Connection(our_role=h11.CLIENT)
        # the answer may come before the body ends (an error, a router shutting down)
        self.answer: asyncio.Task[tuple[int, bytes]] = asyncio.create_task(self._read_answer())

    @classmethod
    async def open(cls, url: str, headers: dict[str, str], timeout_s: float) -> ChunkedPost:
        parts = urlsplit(url)
        https = parts.scheme == "https"
        context = ssl.create_default_context() if https else None
        port = parts.port or (443 if https else 80)
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(parts.hostname, port, ssl=context), timeout_s
        )
        post = cls(reader, writer)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        head = [("Host", parts.netloc), ("Transfer-Encoding", "chunked"), *headers.items()]
        writer.write(post._conn.send(h11.Request(method="POST", target=target, headers=head)))
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
        status = 0
        body = bytearray()
        while True:
            event = self._conn.next_event()
            if event is h11.NEED_DATA:  # b"" at the end: h11 tells a whole answer from a cut one
                self._conn.receive_data(await self._reader.read(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return status, bytes(body)
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("the server closed the connection before answering")
