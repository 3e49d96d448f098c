"""Prompts of exact token counts with the checkpoint's own tokenizer and chat template."""

from __future__ import annotations

from pathlib import Path

import pytest

from epd_engine.bench.payloads import chat_payload
from epd_engine.bench.token_prompts import TokenExactPrompts
from epd_engine.contracts.trace import ImageRef, TraceRecord


@pytest.fixture(scope="module")
def builders(tiny_model_dir: Path) -> dict[str, TokenExactPrompts]:
    return {m: TokenExactPrompts.from_model_dir(tiny_model_dir, m) for m in ("template", "content")}


@pytest.mark.parametrize("mode", ["template", "content"])
def test_every_length_is_hit_exactly(builders: dict[str, TokenExactPrompts], mode: str) -> None:
    prompts = builders[mode]
    for num_tokens in (20, 21, 57, 128, 333, 1000):
        for images in (0, 1, 3):
            text = prompts.text(num_tokens, f"seed-{num_tokens}", images)
            assert prompts.count(text, images) == num_tokens, (num_tokens, images)


def test_template_count_is_what_the_server_adds_images_to(
    builders: dict[str, TokenExactPrompts],
) -> None:
    image = ImageRef(tokens=16, hash="h", width=32, height=32)
    record = TraceRecord(request_id="r", arrival_s=0, prompt_tokens=90, images=(image, image),
                         output_tokens=2)  # fmt: skip
    payload = chat_payload(record, 0, prompts=builders["template"])
    assert payload.expected_prompt_tokens == 90 + 32
    content = chat_payload(record, 0, prompts=builders["content"])
    text = content.messages[0]["content"][-1]["text"]
    assert builders["content"].count(text) == 90
    overhead = builders["template"].overhead(2)
    assert content.expected_prompt_tokens == 90 + overhead + 32


def test_a_count_below_the_template_gives_the_shortest_prompt_not_a_crash(
    builders: dict[str, TokenExactPrompts],
) -> None:
    """Generated workloads can ask for fewer tokens than the template itself takes; the run
    goes on and the usage check reports the difference."""
    prompts = builders["template"]
    overhead = prompts.overhead(1)
    assert prompts.text(overhead - 5, "s", 1) == ""
    record = TraceRecord(arrival_s=0, prompt_tokens=3, output_tokens=1)
    assert chat_payload(record, 0, prompts=prompts).expected_prompt_tokens == 3


def test_shared_blocks_give_shared_prefixes(builders: dict[str, TokenExactPrompts]) -> None:
    prompts = builders["content"]
    a = prompts.text(700, "a", prefix_blocks=[7, 8], block_tokens=256)
    b = prompts.text(600, "b", prefix_blocks=[7, 9], block_tokens=256)
    block = prompts.block_text(7, 256)
    assert a.startswith(block) and b.startswith(block)
    assert not a.startswith(block + prompts.block_text(9, 1))
    assert (prompts.count(a), prompts.count(b)) == (700, 600)
