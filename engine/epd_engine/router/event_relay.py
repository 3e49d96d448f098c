"""Instance events, as lines of an instance's event stream, into the requests in flight.

Each line is one JSON event with ``seq``, numbered per sender ``session``. A sender re-sends
what was not acknowledged after a broken stream, so a ``seq`` already applied is skipped:
each event is applied once, in the order it was sent. Token order across instances is the
``InflightRequest``'s business (``num_output_tokens``).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import AsyncIterable, Callable

from epd_engine.router.inflight import InflightRequest

log = logging.getLogger(__name__)

MAX_SESSIONS = 4096  # senders remembered (instances, and their restarts)


class EventRelay:
    def __init__(
        self,
        inflight: dict[str, InflightRequest],
        on_moved: Callable[[str, str], None] | None = None,
    ) -> None:
        self.inflight = inflight
        # (instance id, router request id): an event placed the request on another instance
        self.on_moved = on_moved
        self._last_seq: OrderedDict[str, int] = OrderedDict()  # session -> last applied

    def last_seq(self, session: str) -> int:
        return self._last_seq.get(session, 0)

    async def consume(self, session: str, body: AsyncIterable[bytes]) -> int:
        """Apply every complete line of ``body`` as it arrives; the last ``seq`` applied."""
        partial = b""
        async for chunk in body:
            lines = (partial + chunk).split(b"\n")
            partial = lines.pop()  # an unfinished line waits for its next chunk
            for line in lines:
                if line:
                    self.apply_line(session, line)
        return self.last_seq(session)

    def apply_line(self, session: str, line: bytes) -> None:
        try:
            event = json.loads(line)
            seq = int(event.pop("seq"))
        except (ValueError, KeyError, TypeError):  # a sender's bug; its stream goes on
            log.error("dropping a malformed event from %s: %r", session, line[:200])
            return
        if seq <= self.last_seq(session):
            return  # re-sent after a broken stream, and applied the first time
        self._last_seq[session] = seq
        self._last_seq.move_to_end(session)
        if len(self._last_seq) > MAX_SESSIONS:
            self._last_seq.popitem(last=False)
        inflight = self.inflight.get(str(event.get("router_request_id")))
        if inflight is not None:
            holder = inflight.holder
            inflight.apply(event)
            if holder is not None and inflight.holder != holder and self.on_moved is not None:
                self.on_moved(holder, inflight.router_request_id)
