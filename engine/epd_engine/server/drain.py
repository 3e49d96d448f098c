"""The engine's drain (``api/draining.py``): it holds nothing when no request is in its
engine, no cache is parked for a target to pull and every event is answered; what is left
at the timeout goes back to the owning router, which resumes it elsewhere from the tokens
already streamed."""

from __future__ import annotations

from epd_engine.api.draining import events_answered, leave_routing
from epd_engine.disagg.router_link import RouterLink
from epd_engine.server.state import InstanceState
from epd_engine.transfer.messages import Routing


async def drain(state: InstanceState | None, timeout_s: float) -> None:
    """Leave routing, wait until this instance holds nothing, hand back what is left at
    ``timeout_s``."""
    if state is None:  # SIGTERM before start-up ended: nothing to drain
        return
    await leave_routing(
        state,
        timeout_s,
        lambda: len(state.engine.streams),
        lambda link: holds_nothing(state, link),
        lambda: _held(state),
    )


def holds_nothing(state: InstanceState, link: RouterLink) -> bool:
    """No request in the engine, no cache parked for a target, every event answered."""
    migration = state.migration
    return (
        not state.engine.streams
        and not (migration is not None and migration.source.handed_to)
        and events_answered(link)
    )


async def _held(state: InstanceState) -> list[Routing]:
    """The routings of the requests the engine still holds (read on its thread)."""

    def held() -> list[Routing]:
        return [s.routing for s in state.engine.streams.values() if s.routing is not None]

    return list(await state.engine.call_async(held))  # type: ignore[call-overload]
