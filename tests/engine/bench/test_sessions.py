"""Multi-turn sessions in ``epdctl bench``: a turn waits for the previous one and sends the
whole conversation, with the replies the server gave."""

from __future__ import annotations

import json
from pathlib import Path

from epd_engine.bench.driver import DriverConfig, replay
from epd_engine.contracts.trace import TraceRecord, read_trace, write_trace
from epd_engine.workload.trace_formats import read_mooncake, write_mooncake
from tests.engine.bench.fake_openai import FakeOpenAI


def turn(session: str | None, i: int, arrival_s: float) -> TraceRecord:
    return TraceRecord(request_id=f"{session}-{i}", arrival_s=arrival_s, prompt_tokens=8,
                       output_tokens=3, session_id=session)  # fmt: skip


def test_a_turn_sends_the_conversation_so_far_after_the_last_turn_ended(
    fake_openai: FakeOpenAI,
) -> None:
    fake_openai.behaviour.first_token_delay_s = 0.2
    # s1's second turn is due before its first has ended; s2 and the lone request are not held
    records = [turn("s1", 0, 0.0), turn("s1", 1, 0.05), turn("s2", 0, 0.05),
               turn(None, 0, 0.05), turn("s1", 2, 0.1)]  # fmt: skip
    config = DriverConfig(endpoint=fake_openai.url, model="fake-model", progress=False)
    results = replay(records, config)
    assert all(r.ok for r in results), [r.error for r in results]
    by_id = {r.request_id: r for r in results}
    first, second, third = by_id["s1-0"], by_id["s1-1"], by_id["s1-2"]
    assert first.e2e_s is not None and second.e2e_s is not None
    assert second.arrival_s >= first.arrival_s + first.e2e_s - 0.01  # waited for the reply
    assert third.arrival_s >= second.arrival_s + second.e2e_s - 0.01
    assert by_id["s2-0"].arrival_s < 0.15 and by_id["None-0"].arrival_s < 0.15
    assert max(r.send_delay_s for r in results) < 0.1  # waiting for a turn is not lag

    sent = [r["messages"] for r in fake_openai.requests]
    longest = max(sent, key=len)
    assert [m["role"] for m in longest] == ["user", "assistant"] * 2 + ["user"]
    assert longest[1]["content"] == longest[3]["content"] == "t0 t1 t2 "  # the real replies
    assert sorted(len(m) for m in sent) == [1, 1, 1, 3, 5]


def test_session_ids_survive_our_format_and_mooncakes(tmp_path: Path) -> None:
    records = [turn("a", 0, 0.0), turn("a", 1, 1.0), turn(None, 0, 2.0)]
    assert [r.session_id for r in read_trace(write_trace(records, tmp_path / "t.jsonl"))] == [
        "a", "a", None,
    ]  # fmt: skip
    path = write_mooncake(records, tmp_path / "m.jsonl")
    assert [json.loads(line).get("session_id") for line in path.read_text().splitlines()] == [
        "a", "a", None,
    ]  # fmt: skip
    assert [r.session_id for r in read_mooncake(path)] == ["a", "a", None]
