"""How far ahead an elastic plan is sized: the time from a decision to the new plan serving.

The loop measures it: from the pass that changed the plan (``status.lastPlanChange``) to the
pass in which every router replica confirmed routing to exactly the plan's pools. The last
measured switch is the horizon of the next forecast; before any, ``DEFAULT_SWITCH_S``.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

# No switch measured yet: a new pod on Kubernetes is scheduled, starts the engine and loads
# its weights in about one to two minutes (a local process switch took 4.7-7.5 s).
DEFAULT_SWITCH_S = 120.0


def rollout_horizon(last_switch_s: float | None) -> tuple[float, str]:
    """(seconds, where they come from) for the forecast."""
    if last_switch_s is None:
        return DEFAULT_SWITCH_S, "default"
    return last_switch_s, "last switch"


def switch_seconds(
    switched: bool,
    confirmed: Iterable[str],
    plan_pools: Iterable[str],
    last_change: datetime | None,
    now: datetime,
) -> float | None:
    """How long the plan took to serve, when this pass's confirmed switch completed it (every
    replica routes to exactly its pools); None otherwise."""
    if not switched or last_change is None or set(confirmed) != set(plan_pools):
        return None
    return max(0.0, (now - last_change).total_seconds())
