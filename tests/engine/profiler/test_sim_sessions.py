"""A session trace's turns are whole prompts in the simulator (``sim_sessions.py``, issue 33).

Defect: a session's record counts only its own message (``epdctl bench`` sends the
conversation so far before it), and the simulator read ``prompt_tokens`` as the whole
prompt: a later turn prefilled only its new message, and nothing was shared between turns.
"""

from __future__ import annotations

import pytest

from epd_engine.config import SLO, Method, Role
from epd_engine.contracts.plan import Plan
from epd_engine.contracts.trace import ImageRef, TraceRecord
from epd_engine.profiler.sim_sessions import SESSION_BLOCK_TOKENS, whole_prompts
from epd_engine.profiler.simulator import simulate

from .factories import toy_cost_model

IMAGE = 100  # the toy cost model's tokens per image: the trace's own
PAGE = 16  # its KV page


def _picture(name: str) -> ImageRef:
    return ImageRef(tokens=IMAGE, hash=name, width=64, height=48)


def _turn(session: str, turn: int, prompt: int, output: int, *images: str) -> TraceRecord:
    return TraceRecord(
        request_id=f"{session}-t{turn}",
        arrival_s=10.0 * turn,
        prompt_tokens=prompt,
        images=tuple(_picture(name) for name in images),
        output_tokens=output,
        session_id=session,
    )


def _three_turns(session: str = "s") -> list[TraceRecord]:
    """A picture and a question, a follow-up, a second picture and a question."""
    return [
        _turn(session, 0, 100, 20, f"{session}-cat"),
        _turn(session, 1, 40, 10),
        _turn(session, 2, 30, 8, f"{session}-dog"),
    ]


def test_a_later_turn_is_the_conversation_so_far_then_its_message() -> None:
    first, second, third = whole_prompts(_three_turns())
    assert [first.prompt_tokens, second.prompt_tokens, third.prompt_tokens] == [
        100,
        100 + 20 + 40,
        100 + 20 + 40 + 10 + 30,
    ]
    # images where bench sends them: each message's images before its text
    assert [(i.hash, i.offset) for i in third.images] == [("s-cat", 0), ("s-dog", 270)]
    assert [i.offset for i in second.images] == [0]
    # ids over the whole prompt: each turn leads with all of the one before's full blocks
    assert first.hash_block_tokens == SESSION_BLOCK_TOKENS
    assert len(first.hash_ids or ()) == 200 // SESSION_BLOCK_TOKENS
    assert (third.hash_ids or ())[: len(second.hash_ids or ())] == second.hash_ids
    assert all(r.whole_prompt for r in (first, second, third))


def test_conversations_share_no_blocks_and_a_second_reading_changes_nothing() -> None:
    trace = whole_prompts(_three_turns("a") + _three_turns("b"))
    assert not set(trace[2].hash_ids or ()) & set(trace[5].hash_ids or ())
    assert whole_prompts(trace) is trace


@pytest.mark.parametrize("served", [IMAGE, 16], ids=["trace-image-tokens", "fewer-served"])
def test_a_later_turn_prefills_the_conversation_and_finds_the_earlier_turns_pages(
    served: int,
) -> None:
    """``served``: the cost model's tokens per image (the ids count the trace's)."""
    plan = Plan(method=Method.EPD, pools={Role.EPD: 1})
    cost = toy_cost_model(tokens_per_image=served)
    result = simulate(plan, _three_turns(), cost, SLO(ttft_s=60.0, tpot_s=10.0))
    assert all(r.ok for r in result.results)
    prompts = [served + 100, served + 100 + 20 + 40, 2 * served + 100 + 20 + 40 + 10 + 30]
    assert result.prefix_queried_tokens == {Role.EPD.value: sum(prompts)}
    # turn t + 1 finds turn t's full pages: its prompt and answer (the last token is sampled,
    # not written)
    written = [prompts[0] + 20 - 1, prompts[1] + 10 - 1]
    assert result.prefix_hit_tokens == {Role.EPD.value: sum(w // PAGE * PAGE for w in written)}
