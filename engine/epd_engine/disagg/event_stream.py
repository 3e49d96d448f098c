"""Instance → router events over one long-lived streaming POST (NDJSON, one event a line).

An HTTP request per batch of events cost about 6 ms each on a busy instance: every
syscall of it (connection checks, send, receive) waits for the GIL held by the engine
thread, and that work slowed the engine thread in turn. Here an event is written to the
open stream in the loop iteration that produced it: the first of an iteration at once, the
rest of the same engine step together one iteration later. Delivery stays exact across
broken connections and router restarts:

- every event carries ``seq``, numbered per ``session`` (one per process), and lines are
  kept until the stream they went on is answered;
- a stream ends after ``max_stream_s`` (the router answers once it has read it all, and
  can shut down gracefully); the next one opens at once;
- after a failed stream every unanswered line is re-sent; the router skips ``seq`` it has
  applied, so nothing is lost, doubled or reordered.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections import deque

import h11

from epd_engine.disagg.chunked_post import ChunkedPost

log = logging.getLogger(__name__)

SESSION_HEADER = "X-EPD-Event-Session"
MAX_BUFFERED_EVENTS = 65536  # unanswered lines kept while the router is away


class StreamRefused(Exception):
    """The router answered the stream with an error, or before it ended."""


class EventStream:
    def __init__(
        self,
        url: str,
        headers: dict[str, str],
        max_stream_s: float = 2.0,
        timeout_s: float = 10.0,
        max_retry_delay_s: float = 2.0,
    ) -> None:
        self.url = url
        self.session = uuid.uuid4().hex
        self.headers = {**headers, SESSION_HEADER: self.session}
        self.max_stream_s = max_stream_s
        self.timeout_s = timeout_s
        self.max_retry_delay_s = max_retry_delay_s
        self._seq = 0
        self._post: ChunkedPost | None = None  # the open stream, if any
        self._pending: list[bytes] = []  # put while no stream was open
        self._unacked: deque[bytes] = deque()  # on a stream not yet answered
        self._burst: list[bytes] | None = None  # put after this iteration's first write

    def put(self, event: dict[str, object]) -> None:
        """Send one event (event-loop thread); events arrive in the order they were put."""
        self._seq += 1
        line = json.dumps({**event, "seq": self._seq}, separators=(",", ":")).encode() + b"\n"
        if self._post is None or not self._post.writable:
            self._pending.append(line)
        else:
            self._unacked.append(line)
            if self._burst is None:  # the first of this iteration: no wait
                self._post.write(line)
                self._burst = []
                asyncio.get_running_loop().call_soon(self._flush_burst)
            else:  # the rest of this engine step's events: one write, next iteration
                self._burst.append(line)
        if len(self._pending) + len(self._unacked) > MAX_BUFFERED_EVENTS:
            self._drop_oldest()

    @property
    def num_unanswered(self) -> int:
        return len(self._pending) + len(self._unacked)

    async def run(self) -> None:
        """Keep a stream open for good; on failure back off and re-send what is unanswered."""
        failures = 0
        while True:
            try:
                await self._stream_once()
                failures = 0
            except (OSError, TimeoutError, h11.ProtocolError, StreamRefused) as exc:
                failures += 1
                log.warning(
                    "event stream to %s failed (%d events unanswered): %r",
                    self.url,
                    self.num_unanswered,
                    exc,
                )
                await asyncio.sleep(min(0.1 * 2**failures, self.max_retry_delay_s))

    async def _stream_once(self) -> None:
        post = await ChunkedPost.open(self.url, self.headers, self.timeout_s)
        try:
            self._unacked.extend(self._pending)  # re-sent lines first, then the new ones
            self._pending = []
            if self._unacked:
                post.write(b"".join(self._unacked))
            self._post = post
            try:
                await asyncio.wait_for(asyncio.shield(post.answer), self.max_stream_s)
                raise StreamRefused(f"answered before the stream ended: {post.answer.result()}")
            except TimeoutError:  # the stream's time is up: end it
                self._detach()
                post.end()
            status, body = await asyncio.wait_for(post.answer, self.timeout_s)
            if status != 200:
                raise StreamRefused(f"{status}: {body[:200]!r}")
            self._unacked.clear()  # the router read the whole stream before answering
        finally:
            self._detach()
            post.close()

    def _flush_burst(self) -> None:
        burst, self._burst = self._burst, None
        if burst and self._post is not None and self._post.writable:
            self._post.write(b"".join(burst))
        # else: the stream is gone; the lines are unanswered and go again on the next one

    def _detach(self) -> None:
        """No more writes to this stream: what is put from now on waits for the next."""
        self._flush_burst()
        self._post = None

    def _drop_oldest(self) -> None:
        """The router has been away too long: bound memory, losing the oldest event."""
        if self._unacked:
            self._unacked.popleft()
        else:
            self._pending.pop(0)
        if self._seq % 1000 == 0:
            log.error("router unreachable: dropping its oldest unanswered events")
