"""The multi-turn conversation workload (``workload/conversations.py``)."""

from __future__ import annotations

from collections import defaultdict
from itertools import pairwise

from epd_engine.contracts.trace import TraceRecord
from epd_engine.workload.conversations import conversations


def _sessions(records: list[TraceRecord]) -> dict[str, list[TraceRecord]]:
    by_session: dict[str, list[TraceRecord]] = defaultdict(list)
    for record in records:
        by_session[record.session_id or ""].append(record)
    return by_session


def test_sessions_of_two_to_four_turns_some_with_images() -> None:
    records = conversations(60, seed=3)
    assert len(records) == 60 and records == conversations(60, seed=3)
    sessions = list(_sessions(records).values())
    assert all(2 <= len(turns) <= 4 for turns in sessions[:-1])  # the last may be cut short
    assert any(turns[0].images for turns in sessions)
    assert any(turn.images for turns in sessions for turn in turns[1:])
    assert any(not turn.images for turns in sessions for turn in turns)
    # a turn is its own message: bench and the simulator add the conversation before it
    assert not any(record.whole_prompt for record in records)


def test_a_sessions_next_turn_comes_a_round_after_the_last() -> None:
    records = conversations(30, seed=1)
    sessions = _sessions(records)
    for turns in sessions.values():
        gaps = {b.arrival_s - a.arrival_s for a, b in pairwise(turns)}
        assert gaps <= {float(len(sessions))}
