"""EventStream against a real router: streams that end and reopen every few tens of
milliseconds still deliver every event once, in order."""

from __future__ import annotations

import asyncio

from epd_engine.config import internal_token
from epd_engine.disagg.event_stream import EventStream
from tests.engine.router.live import TcpProxy, live_router, track, wait_for_tokens


def event(n: int) -> dict[str, object]:
    return {
        "router_request_id": "req-1",
        "attempt": 0,
        "instance_id": "i-0",
        "pool": "p",
        "token_ids": [n],
        "text_delta": f"{n},",
        "num_output_tokens": n,
        "stage_timings": [{"stage": "decode", "queue_s": 0.0, "exec_s": 1.0}],
    }


async def test_events_cross_many_stream_ends_exactly_once() -> None:
    async with live_router() as (url, app):
        proxy = TcpProxy(int(url.rsplit(":", 1)[1]))  # counts the streams
        await proxy.open()
        request = track(app, "req-1")
        stream = EventStream(
            f"{proxy.url}/internal/event-stream",
            {"X-EPD-Token": internal_token()},
            max_stream_s=0.05,
        )
        sender = asyncio.create_task(stream.run())
        for n in range(1, 101):
            stream.put(event(n))
            if n % 10 == 0:  # bursts of ten, spread over several streams
                await asyncio.sleep(0.03)
        await wait_for_tokens(request, 100)
        sender.cancel()
        await proxy.close()

    assert request.token_ids == list(range(1, 101))
    assert request.stage_s["decode"] == 100.0  # each event applied once
    assert proxy.num_connections > 3  # a stream per connection
