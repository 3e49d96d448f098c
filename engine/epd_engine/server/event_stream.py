"""Instance → router events over one long-lived streaming POST (NDJSON, one event a line).

An HTTP request per batch of events cost about 6 ms each on a busy instance: every
syscall of it (connection checks, send, receive) waits for the GIL held by the engine
thread, and that work slowed the engine thread in turn. A stream costs one ``send`` per
batch. Delivery stays exact across broken connections and router restarts:

- every event carries ``seq``, numbered per ``session`` (one per process), and lines are
  kept until the router acknowledges them;
- a stream ends after ``max_stream_s`` (the router then answers with the last ``seq`` it
  applied, and can shut down gracefully); the next one opens at once;
- a failed stream is re-sent whole on the next; the router skips ``seq`` it has applied,
  so nothing is lost, doubled or reordered.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections import deque
from collections.abc import AsyncIterator

import httpx

log = logging.getLogger(__name__)

SESSION_HEADER = "X-EPD-Event-Session"
MAX_BUFFERED_EVENTS = 65536  # unacknowledged lines kept while the router is away


class EventStream:
    def __init__(
        self,
        url: str,
        headers: dict[str, str],
        http: httpx.AsyncClient,
        max_stream_s: float = 2.0,
        max_retry_delay_s: float = 2.0,
    ) -> None:
        self.url = url
        self.session = uuid.uuid4().hex
        self.headers = {**headers, SESSION_HEADER: self.session}
        self.http = http
        self.max_stream_s = max_stream_s
        self.max_retry_delay_s = max_retry_delay_s
        self._seq = 0
        self._pending: list[bytes] = []  # not yet written to any stream
        self._unacked: deque[tuple[int, bytes]] = deque()  # written, not yet acknowledged
        self._wakeup = asyncio.Event()

    def put(self, event: dict[str, object]) -> None:
        """Queue one event (event-loop thread); events leave in the order they were put."""
        self._seq += 1
        line = json.dumps({**event, "seq": self._seq}, separators=(",", ":"))
        self._pending.append(line.encode() + b"\n")
        self._wakeup.set()
        if self.num_unacknowledged > MAX_BUFFERED_EVENTS:
            self._drop_oldest()

    @property
    def num_unacknowledged(self) -> int:
        return len(self._pending) + len(self._unacked)

    async def run(self) -> None:
        """Keep a stream open for good; on failure back off and re-send what is unacked."""
        failures = 0
        while True:
            try:
                await self._stream_once()
                failures = 0
            except httpx.HTTPError as exc:
                failures += 1
                log.warning(
                    "event stream to %s failed (%d unacknowledged): %r",
                    self.url,
                    self.num_unacknowledged,
                    exc,
                )
                await asyncio.sleep(min(0.1 * 2**failures, self.max_retry_delay_s))

    async def _stream_once(self) -> None:
        response = await self.http.post(
            self.url,
            content=self._body(),
            headers=self.headers,
            timeout=httpx.Timeout(10.0, pool=None),
        )
        response.raise_for_status()
        self._acknowledge(int(response.json()["seq"]))

    async def _body(self) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        if self._unacked:  # the last stream broke: the router skips what it applied
            yield b"".join(line for _, line in self._unacked)
        end_s = loop.time() + self.max_stream_s
        while (left_s := end_s - loop.time()) > 0:
            if not self._pending:
                self._wakeup.clear()
                try:  # asyncio.timeout, not wait_for: no task per wait on the hot path
                    async with asyncio.timeout(left_s):
                        await self._wakeup.wait()
                except TimeoutError:
                    return
            lines, self._pending = self._pending, []
            first_seq = self._seq - len(lines) + 1
            self._unacked.extend(enumerate(lines, start=first_seq))
            yield b"".join(lines)

    def _acknowledge(self, seq: int) -> None:
        while self._unacked and self._unacked[0][0] <= seq:
            self._unacked.popleft()

    def _drop_oldest(self) -> None:
        """The router has been away too long: bound memory, losing the oldest event."""
        if self._unacked:
            self._unacked.popleft()
        else:
            self._pending.pop(0)
        if self._seq % 1000 == 0:
            log.error("router unreachable: dropping its oldest unacknowledged events")
