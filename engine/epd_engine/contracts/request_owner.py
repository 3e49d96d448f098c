"""Which router replica owns a request: its id says so.

Several router replicas share one deployment's instances. A request is owned by the replica
its client reached (only that one holds the client's connection and the request in flight),
so every event about it must reach that replica. The owner's id is part of the request's id,
``req-<router_id>-<16 hex>``: everything an instance sends about a request (tokens, hand-over
notes, migration times, retries) is keyed by that id already, so it routes itself, and a
migration carries it to the next instance with nothing added.
"""

from __future__ import annotations

import uuid

ROUTER_ID_CHARS = 8
PREFIX = "req"


def new_router_id() -> str:
    """A replica's id, fresh per process: a restarted router owns none of its old requests."""
    return uuid.uuid4().hex[:ROUTER_ID_CHARS]


def new_request_id(router_id: str) -> str:
    return f"{PREFIX}-{router_id}-{uuid.uuid4().hex[:16]}"


def owner_of(router_request_id: str) -> str | None:
    """The owning replica's id; None for an id that names none (made elsewhere)."""
    parts = router_request_id.split("-")
    if len(parts) == 3 and parts[0] == PREFIX and len(parts[1]) == ROUTER_ID_CHARS:
        return parts[1]
    return None
