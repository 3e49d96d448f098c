"""When each start-up phase of this process ended (wall-clock seconds since the epoch).

The engine marks its phases (``main`` once the interpreter runs our code, ``imports`` once
torch and the server are imported, ``model_loaded``, ``budgets``, ``engine_built``,
``serving``, ``registered`` at the first heartbeat the router accepted); ``GET /health/ready``
returns them so whoever started the process (``epdctl up``, the switch benchmark) can say
where the time from a decision to a serving pool went.
"""

from __future__ import annotations

import time

PHASES: dict[str, float] = {}


def mark(phase: str) -> None:
    """Record the first time ``phase`` ended (later calls keep the first)."""
    PHASES.setdefault(phase, time.time())


def timeline() -> dict[str, float]:
    return dict(PHASES)
