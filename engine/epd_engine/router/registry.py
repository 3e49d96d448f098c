"""Instances known to the router: upserted by heartbeats, dropped when they go quiet.

The load routing sees is an instance's last heartbeat plus the requests this router sent it
since that heartbeat and that are still there: a burst between heartbeats spreads out, and a
request that finished or moved on to the next pool counts no more. (Counting every request
sent until the next heartbeat made a run of short sequential requests look like a queue, and
the load bound then sent a conversation's turn away from the instance holding its prefix.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from epd_engine.contracts.routing_policy import InstanceLoad


@dataclass
class _Entry:
    load: InstanceLoad  # as its last heartbeat said
    last_seen_s: float
    # router request ids sent here since that heartbeat and not gone (finished, moved on)
    sent: set[str] = field(default_factory=set)

    def current(self) -> InstanceLoad:
        if not self.sent:
            return self.load
        return replace(self.load, num_waiting=self.load.num_waiting + len(self.sent))


class Registry:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._entries: dict[str, _Entry] = {}
        self.active_pools: set[str] | None = None  # None: every pool takes new requests

    def heartbeat(self, load: InstanceLoad) -> bool:
        """Record a heartbeat; True when the instance is new."""
        is_new = load.instance_id not in self._entries
        self._entries[load.instance_id] = _Entry(load, time.monotonic())
        return is_new

    def expire(self) -> list[InstanceLoad]:
        """Drop and return instances whose heartbeat lapsed."""
        now = time.monotonic()
        dead = [e.current() for e in self._entries.values() if now - e.last_seen_s > self.timeout_s]
        for load in dead:
            del self._entries[load.instance_id]
        return dead

    def remove(self, instance_id: str) -> None:
        self._entries.pop(instance_id, None)

    def all(self) -> list[InstanceLoad]:
        return [e.current() for e in self._entries.values()]

    def active(self) -> list[InstanceLoad]:
        """Instances that may take new work: their pool is routed to and they are not
        shutting down (a draining instance stays known: its requests' events and aborts
        still reach it, and the operator counts what it holds as in flight)."""
        loads = [load for load in self.all() if not load.draining]
        if self.active_pools is None:
            return loads
        return [load for load in loads if load.pool in self.active_pools]

    def get(self, instance_id: str) -> InstanceLoad | None:
        entry = self._entries.get(instance_id)
        return entry.current() if entry else None

    def note_assigned(self, instance_id: str, request_id: str) -> None:
        """Count a request we just sent there until its next heartbeat counts it itself."""
        entry = self._entries.get(instance_id)
        if entry is not None:
            entry.sent.add(request_id)

    def note_gone(self, instance_id: str, request_id: str) -> None:
        """The request left the instance (finished, handed on, re-routed): count it no more."""
        entry = self._entries.get(instance_id)
        if entry is not None:
            entry.sent.discard(request_id)
