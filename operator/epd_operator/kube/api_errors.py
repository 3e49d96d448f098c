"""API errors that a retry cannot fix, surfaced in status instead of retried in silence.

A 422 (say a child Deployment the API server finds invalid), a 400, or a 403 (the chart's
RBAC lacks a verb) fails every pass the same way: the EPDDeployment gets Degraded with reason
ApiRejected or Forbidden and the server's own message (which names the object and field),
and one Warning event when that message is new. The timer still comes back at the resync
interval, so a fixed spec or cluster recovers without a restart. Other errors (conflicts,
5xx, timeouts) stay transient retries.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.exceptions import ApiException

from epd_operator.kube.controller import _status, merge_conditions

PERMANENT = {400: "ApiRejected", 422: "ApiRejected", 403: "Forbidden"}


def reason_of(exc: ApiException) -> str | None:
    """The Degraded reason of an error a retry cannot fix; None for a transient one."""
    return PERMANENT.get(int(exc.status or 0))


def message_of(exc: ApiException) -> str:
    """The API server's Status message (names the object and the field), else the reason."""
    try:
        body = json.loads(exc.body or "")
    except (TypeError, ValueError):
        body = {}
    message = body.get("message") if isinstance(body, dict) else None
    return f"API error {exc.status}: {message or exc.reason}"


def degraded_status(
    raw_status: dict[str, Any] | None, exc: ApiException, generation: int
) -> dict[str, Any]:
    """``raw_status`` with Degraded set by ``exc``; Ready and Progressing as they were."""
    reason = reason_of(exc) or "ApiError"
    status = _status(raw_status)
    before = {c.type: (c.status, c.reason, c.message) for c in status.conditions}
    unknown = ("Unknown", "ApiError", "not evaluated: the last pass failed")
    conditions = merge_conditions(
        status.conditions,
        {
            "Ready": before.get("Ready", unknown),
            "Progressing": before.get("Progressing", unknown),
            "Degraded": ("True", reason, message_of(exc)),
        },
        generation,
        datetime.now(UTC),
    )
    new = status.model_copy(update={"conditions": conditions})
    return new.model_dump(mode="json", by_alias=True)


def report(
    raw_status: dict[str, Any] | None,
    exc: ApiException,
    generation: int,
    post_event: Callable[[str, str, str], None],
) -> dict[str, Any]:
    """The handler's hook: the degraded status, and a Warning event when the message is new."""
    before = next((c for c in _status(raw_status).conditions if c.type == "Degraded"), None)
    new = degraded_status(raw_status, exc, generation)
    degraded = next(c for c in new["conditions"] if c["type"] == "Degraded")
    if before is None or before.message != degraded["message"]:
        post_event("Warning", degraded["reason"], degraded["message"])
    return new
