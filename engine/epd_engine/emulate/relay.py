"""A router request's events, from the emulated loop onto the router link's event stream, in
``RouterLink.send``'s shape (the emulator has no ``RequestOutput`` and no detokenizer: each
event carries its token's text). The entry instance and each migration target relay the
part of the request they run; a request handed off ends its relay without finishing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from typing import Any

from epd_engine.disagg.router_link import RouterLink
from epd_engine.emulate.tokens import token_text
from epd_engine.metrics import Metrics
from epd_engine.scheduler import RequestEvent
from epd_engine.transfer.messages import Routing


def router_event(
    link: RouterLink, routing: Routing, event: RequestEvent, num_prompt: int, num_output: int
) -> dict[str, Any]:
    token_ids = [event.new_token_id] if event.new_token_id is not None else []
    return {
        "router_request_id": routing.router_request_id,
        "attempt": routing.attempt,
        "instance_id": link.identity.instance_id,
        "pool": link.identity.pool,
        "token_ids": token_ids,
        "text_delta": "".join(token_text(t) for t in token_ids),
        "num_prompt_tokens": num_prompt,
        "num_output_tokens": num_output,
        "num_cached_tokens": 0,
        "finish_reason": event.finish_reason,
        "error": None,
        "stage_timings": [],
    }


def announce(link: RouterLink, routing: Routing) -> None:
    """Tell the router this instance holds the request now (it re-routes it if we die)."""
    link.send_raw(
        {
            "router_request_id": routing.router_request_id,
            "attempt": routing.attempt,
            "instance_id": link.identity.instance_id,
            "pool": link.identity.pool,
        }
    )


def start_relay(
    relays: dict[str, asyncio.Task[None]],
    link: RouterLink,
    metrics: Metrics,
    routing: Routing,
    request_id: str,
    events: AsyncGenerator[RequestEvent, None],
    first: RequestEvent | None,
    num_prompt: int,
    num_output: int = 0,
    on_end: Callable[[str], None] | None = None,
) -> None:
    """Relay ``events`` (``first`` already taken, or None) until the request finishes here
    or is handed off; ``num_output``: tokens the client had before this instance's part.
    Kept in ``relays`` under ``request_id`` so that an abort can cancel it; ``on_end`` is
    told its id once it has ended."""

    async def relay() -> None:
        count = num_output
        event = first if first is not None else await anext(events, None)
        finished = False
        try:
            while event is not None:
                count += event.new_token_id is not None
                finished = event.finish_reason is not None
                link.send_raw(router_event(link, routing, event, num_prompt, count))
                event = await anext(events, None)
            if finished:  # not a hand-off: the request ended here
                metrics.requests.labels(**metrics.labels, outcome="success").inc()
        finally:
            await events.aclose()  # an abort (cancelled) frees the request's pages now

    task = asyncio.create_task(relay())
    relays[request_id] = task

    def forget(done: asyncio.Task[None]) -> None:
        if relays.get(request_id) is done:  # not a later copy of it (ED+P: back here)
            del relays[request_id]
        if on_end is not None:
            on_end(request_id)

    task.add_done_callback(forget)
