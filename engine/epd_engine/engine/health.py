"""Whether an instance can serve, for its probes and its router.

An instance is out of service for good once its device failed with a sticky error
(``device_errors.py``) or its engine thread made no progress for ``stall_timeout_s`` while
it had work (a step stuck on a hung device, a deadlock). Nothing clears that but a restart:
``/health/live`` and ``/health/ready`` answer 503 (the kubelet restarts the container), the
heartbeat tells the router, which takes the instance out of routing at once and re-routes
what it held, and new requests are refused with 503.

Progress is a mark the engine thread sets as it starts each piece of work (an inbox task,
a step) and clears when it sleeps for lack of work; the stall check (any thread) compares
the mark's age with the timeout.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)


class EngineHealth:
    def __init__(self, stall_timeout_s: float | None) -> None:
        """``stall_timeout_s``: None or 0 turns the stall check off."""
        self.stall_timeout_s = stall_timeout_s or None
        self._reason: str | None = None
        self._working_since_s: float | None = None  # monotonic; None while the thread sleeps
        self._lock = threading.Lock()

    def fail(self, reason: str) -> None:
        """Out of service until the process restarts; the first reason stays."""
        with self._lock:
            if self._reason is not None:
                return
            self._reason = reason
        log.error("instance out of service: %s", reason)

    # ---- engine thread ----------------------------------------------------------------
    def working(self) -> None:
        """The engine thread starts a piece of work (progress)."""
        self._working_since_s = time.monotonic()

    def sleeping(self) -> None:
        """The engine thread waits for work: no stall can build up."""
        self._working_since_s = None

    # ---- any thread -------------------------------------------------------------------
    def check(self) -> str | None:
        """Why the instance is out of service (None: it serves). Looks for a stall first."""
        since = self._working_since_s
        timeout = self.stall_timeout_s
        if self._reason is None and timeout is not None and since is not None:
            stalled_s = time.monotonic() - since
            if stalled_s > timeout:
                self.fail(
                    f"the engine thread made no progress for {stalled_s:.0f} s while it had "
                    f"work (stall timeout {timeout:g} s): a hung device or a deadlock"
                )
        return self._reason

    @property
    def ok(self) -> bool:
        return self.check() is None
