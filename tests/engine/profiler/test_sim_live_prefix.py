"""The simulator's prefix model on the router's live trace (issue 33): ids over blocks of
the whole prompt (``hash_block_tokens``), images at the offsets the server gave them. A
conversation whose second turn brings a new image still finds the first turn's blocks, and
the pages of its answer (``sim_turns.py``), as the engine does; laid out the bench's way
(images first) the new image would hide them."""

from __future__ import annotations

from epd_engine.cache.trace_blocks import MAX_TRACE_BLOCKS, TRACE_BLOCK_TOKENS, trace_hash_ids
from epd_engine.config import SLO, Method, Role
from epd_engine.contracts.plan import Plan
from epd_engine.contracts.trace import ImageRef, TraceRecord
from epd_engine.profiler.sim_prefix import best_case_hits
from epd_engine.profiler.simulator import simulate
from epd_engine.request import ImageRef as PromptImage

from .factories import toy_cost_model

BLOCK, PAGE, ANSWER = 64, 16, 20
EPD = Role.EPD.value


def _image(seed: int, offset: int | None) -> ImageRef:
    return ImageRef(tokens=100, hash=f"img{seed}", width=64, height=48, offset=offset)


def _conversation(offsets: bool = True) -> list[TraceRecord]:
    """Turn 1: 40 text tokens, an image, 60 more (200: three full blocks), a 20-token answer.
    Turn 2 resends it with its answer, 100 more text tokens and a second image (500 tokens:
    seven blocks)."""
    first = TraceRecord(
        arrival_s=0.0, prompt_tokens=100, output_tokens=ANSWER, images=(_image(1, 40 if offsets
        else None),), hash_ids=(11, 12, 13), hash_block_tokens=BLOCK,
    )  # fmt: skip
    second = TraceRecord(
        arrival_s=5.0, prompt_tokens=300, output_tokens=4,
        images=(_image(1, 40 if offsets else None), _image(2, 350 if offsets else None)),
        hash_ids=(11, 12, 13, 14, 15, 16, 17), hash_block_tokens=BLOCK,
    )  # fmt: skip
    return [first, second]


def _hits(records: list[TraceRecord]) -> int:
    plan = Plan(method=Method.EPD, pools={Role.EPD: 1})
    result = simulate(plan, records, toy_cost_model(), SLO(ttft_s=60.0, tpot_s=10.0))
    assert all(r.ok for r in result.results), [r.error for r in result.results if not r.ok]
    return result.prefix_hit_tokens.get(EPD, 0)


def test_a_live_conversation_finds_its_first_turn_and_answer_past_a_new_image() -> None:
    written = 200 + ANSWER - 1  # the last answer token is sampled, never written
    assert _hits(_conversation()) == written // PAGE * PAGE > 3 * BLOCK
    assert sum(best_case_hits(_conversation())) == written
    # without offsets the images go first: the second image sits where turn 1 had text
    assert _hits(_conversation(offsets=False)) < 3 * BLOCK


def test_trace_ids_name_prefixes_of_tokens_and_images_and_stay_bounded() -> None:
    tokens = list(range(300))
    image = PromptImage("cat", offset=70, num_tokens=20, width=64, height=48)
    ids = trace_hash_ids(tokens, [image])
    assert len(ids) == 300 // TRACE_BLOCK_TOKENS
    assert trace_hash_ids(tokens[:200], [image]) == ids[:3]  # a prefix: the leading ids
    assert all(0 <= i < 2**63 for i in ids)
    other = PromptImage("dog", offset=70, num_tokens=20, width=64, height=48)
    changed = trace_hash_ids(tokens, [other])
    assert changed[0] == ids[0] and changed[1:] != ids[1:]  # from the image's block on
    assert trace_hash_ids([5] * 300, []) != trace_hash_ids([6] + [5] * 299, [])
    long = trace_hash_ids([1] * (TRACE_BLOCK_TOKENS * (MAX_TRACE_BLOCKS + 5)), [])
    assert len(long) == MAX_TRACE_BLOCKS
