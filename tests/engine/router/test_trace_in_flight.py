"""The live trace with the requests still in flight (``/v1/trace?in_flight=1``).

Defect it prevents: the router recorded a request when it finished, so under a backlog the
planner's window held only what the fleet managed: ``make bench-elastic`` saw re-plans read
0.6-1.5 rps while 3.8-6.1 rps were sent, and the loop wanted to scale down at the peak. A
real router app on loopback; its requests in flight are registered as ``Dispatcher.start``
does (``live.track``), one finished request recorded as ``Dispatcher.finish`` records it."""

from __future__ import annotations

import asyncio
import time

from epd_engine.config import internal_token
from epd_engine.contracts.trace import TraceRecord
from epd_operator.rollout.router_api import RouterAPI
from tests.engine.router.live import dispatcher, live_router, track


async def test_the_window_read_in_flight_counts_requests_not_finished() -> None:
    async with live_router() as (url, app):
        router = dispatcher(app)
        now_s = time.monotonic() - router.started_s
        router.recorder.record(TraceRecord(arrival_s=now_s, prompt_tokens=30, output_tokens=8))
        waiting = track(app, "r-waiting")  # not yet answered by its entry instance
        waiting.arrival_s = time.monotonic()
        decoding = track(app, "r-decoding")  # its prompt known, two tokens out
        decoding.arrival_s = time.monotonic()
        decoding.prompt_info = {"prompt_tokens": 12}
        decoding.token_ids = [5, 6]
        api = RouterAPI(url, internal_token())

        served = await asyncio.to_thread(api.trace_window, 60.0)
        offered = await asyncio.to_thread(api.trace_window, 60.0, True)

    assert served is not None and offered is not None
    assert [r.in_flight for r in served.records] == [None]
    by_id = {r.request_id: r for r in offered.records if r.in_flight}
    assert len(offered.records) == 3 and set(by_id) == {"r-waiting", "r-decoding"}
    assert by_id["r-decoding"].prompt_tokens == 12 and by_id["r-decoding"].output_tokens == 2
    assert by_id["r-waiting"].prompt_tokens == 0 and by_id["r-waiting"].output_tokens == 1
