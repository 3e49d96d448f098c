"""Gemma 3 through the engine (scheduler, image cache, chunked prefill, batching): greedy
tokens equal transformers' generate(), with prompts longer than the sliding window and,
at a small token budget, chunk ends that would fall inside an image (the scheduler keeps
each image whole: its tokens attend to each other both ways)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from epd_engine.model.gemma3_processor import load_gemma3_processor
from tests.engine.model.engine_parity import engine_greedy, transformers_greedy

MAX_TOKENS = 12
CASES: dict[str, tuple[str, list[tuple[int, int]]]] = {
    "text": ("Write a short story about a fisherman and the sea at dawn.", []),
    "one": ("What is shown in this image?", [(90, 60)]),
    "two": ("Compare the two images.", [(64, 64), (90, 60)]),
}


@pytest.fixture(scope="module")
def expected(tiny_gemma3_dir: Path) -> dict[str, list[int]]:
    """transformers' greedy tokens for every case."""
    from transformers import Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(
        tiny_gemma3_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return transformers_greedy(model, load_gemma3_processor(tiny_gemma3_dir), CASES, MAX_TOKENS)


@pytest.mark.parametrize("token_budget", [512, 12])  # one prefill each; chunks meet images
def test_engine_tokens_match_transformers(tiny_gemma3_dir, expected, token_budget):
    tokens, prompts = engine_greedy(tiny_gemma3_dir, CASES, MAX_TOKENS, token_budget)
    assert [[i.num_tokens for i in p.images] for p in prompts.values()] == [[], [16], [16, 16]]
    assert all(len(p.token_ids) > 16 for p in prompts.values())  # past the window
    assert tokens == expected
    assert all(len(t) > 1 for t in tokens.values())
