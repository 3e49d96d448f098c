"""EventRelay: each line of an instance's stream applied once, in order, as it arrives."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from epd_engine.api.protocol import ChatCompletionRequest
from epd_engine.router.event_relay import EventRelay
from epd_engine.router.inflight import InflightRequest


def inflight(router_request_id: str = "req-1") -> InflightRequest:
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    return InflightRequest(router_request_id, body, 0.0)


def line(seq: int, num_output_tokens: int, finish: str | None = None) -> bytes:
    event = {
        "seq": seq,
        "router_request_id": "req-1",
        "attempt": 0,
        "instance_id": "i-0",
        "pool": "p",
        "token_ids": [100 + num_output_tokens],
        "text_delta": f"t{num_output_tokens} ",
        "num_output_tokens": num_output_tokens,
        "finish_reason": finish,
        "stage_timings": [{"stage": "decode", "queue_s": 0.0, "exec_s": 1.0}],
    }
    return json.dumps(event).encode() + b"\n"


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def test_lines_split_anywhere_are_applied_whole_and_in_order() -> None:
    request = inflight()
    relay = EventRelay({"req-1": request})
    data = b"".join(line(seq, seq) for seq in range(1, 5))
    parts = [data[i : i + 7] for i in range(0, len(data), 7)]  # lines cut mid-way

    assert await relay.consume("s", chunks(*parts)) == 4

    assert request.token_ids == [101, 102, 103, 104]
    assert request.text == "t1 t2 t3 t4 "


async def test_resent_lines_are_skipped_so_timings_count_once() -> None:
    request = inflight()
    relay = EventRelay({"req-1": request})
    await relay.consume("s", chunks(line(1, 1), line(2, 2)))

    # the stream broke before its answer: the sender re-sends 1..2, then goes on
    await relay.consume("s", chunks(line(1, 1), line(2, 2), line(3, 3, "length")))

    assert request.token_ids == [101, 102, 103]
    assert request.finish_reason == "length"
    assert request.stage_s["decode"] == 3.0  # one second per event, each applied once


async def test_sessions_are_numbered_apart() -> None:
    request = inflight()
    relay = EventRelay({"req-1": request})
    await relay.consume("old", chunks(line(1, 1), line(2, 2)))

    await relay.consume("new", chunks(line(1, 3)))  # a restarted sender starts again at 1

    assert request.token_ids == [101, 102, 103]
    assert relay.last_seq("old") == 2
    assert relay.last_seq("new") == 1


async def test_a_malformed_line_is_dropped_and_the_stream_goes_on() -> None:
    request = inflight()
    relay = EventRelay({"req-1": request})

    await relay.consume("s", chunks(line(1, 1), b"{not json\n", b'{"no_seq": 1}\n', line(2, 2)))

    assert request.token_ids == [101, 102]


async def test_events_of_unknown_requests_still_advance_the_sequence() -> None:
    relay = EventRelay({})  # e.g. a restarted router: it knows none of them

    assert await relay.consume("s", chunks(line(1, 1), line(2, 2))) == 2
