"""An emulated instance drains on SIGTERM as an engine does (``api/draining.py``), so a
scale-down of emulated pods loses no request either.

It holds nothing when no router request is relayed from it, its scheduler has no request
(waiting, running or parked for a target's pull), no hand-off is in flight and every event
is answered; at the timeout each request it still relays goes back to its router.
"""

from __future__ import annotations

from epd_engine.api.draining import events_answered, leave_routing
from epd_engine.disagg.router_link import RouterLink
from epd_engine.emulate.routes import EmulatedState
from epd_engine.transfer.messages import Routing


async def drain_emulated(state: EmulatedState | None, timeout_s: float) -> None:
    if state is None:  # SIGTERM before start-up ended: nothing to drain
        return
    await leave_routing(
        state,
        timeout_s,
        lambda: len(state.relays),
        lambda link: holds_nothing(state, link),
        lambda: _held(state),
    )


def holds_nothing(state: EmulatedState, link: RouterLink) -> bool:
    scheduler = state.loop.engine.scheduler
    migration = state.migration
    return (
        not state.relays
        and not scheduler.has_work()
        and not scheduler.migrating
        and not (migration is not None and migration.tasks)
        and events_answered(link)
    )


async def _held(state: EmulatedState) -> list[Routing]:
    """The routings of the requests still relayed from here."""
    migration = state.migration
    if migration is None:
        return []
    return [r for request_id, r in migration.routings.items() if request_id in state.relays]
