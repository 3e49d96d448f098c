"""An emulated instance drains on SIGTERM as an engine does (``api/draining.py``), so a
scale-down of emulated pods loses no request either.

It holds nothing when no router request is relayed from it, its scheduler has no request
(waiting, running or parked for a target's pull), no hand-off is in flight and every event
is answered; at the timeout each request it still relays goes back to its router.
"""

from __future__ import annotations

import asyncio
import logging

from epd_engine.api.draining import events_answered, leave_routing
from epd_engine.emulate.routes import EmulatedState

log = logging.getLogger(__name__)


async def drain_emulated(state: EmulatedState | None, timeout_s: float) -> None:
    if state is None:  # SIGTERM before start-up ended: nothing to drain
        return
    state.ready = False
    link = state.link
    if link is None:  # no router: uvicorn's shutdown waits for open responses
        return
    log.warning("draining: no new requests; finishing %d in flight", len(state.relays))
    await leave_routing(link, lambda: holds_nothing(state), lambda: _hand_back(state), timeout_s)


def holds_nothing(state: EmulatedState) -> bool:
    scheduler = state.loop.engine.scheduler
    migration = state.migration
    return (
        not state.relays
        and not scheduler.has_work()
        and not scheduler.migrating
        and not (migration is not None and migration.tasks)
        and (state.link is None or events_answered(state.link))
    )


async def _hand_back(state: EmulatedState) -> None:
    """Ask the routers to re-route every request still relayed from here."""
    link, migration = state.link, state.migration
    if link is None or migration is None:
        return
    routings = [r for request_id, r in migration.routings.items() if request_id in state.relays]
    log.warning("drain timed out: handing %d request(s) back to the router", len(routings))
    await asyncio.gather(
        *(link.retry(r, "its instance shut down before finishing it") for r in routings)
    )
