"""Qwen3-VL through the engine (scheduler, paged image cache with DeepStack rows, chunked
prefill, batching): greedy tokens equal transformers' generate() for images of different
sizes, including one whose rows span several image-cache pages and prefill chunks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from epd_engine.engine.llm_engine import LLMEngine
from epd_engine.model.qwen3_vl_processor import load_qwen3_vl_processor
from tests.engine.model.engine_parity import engine_greedy, transformers_greedy

MAX_TOKENS = 12
# (text, image sizes): 6, 4 + 6 and 108 image tokens (two 64-token pages)
CASES: dict[str, tuple[str, list[tuple[int, int]]]] = {
    "text": ("Write a short story about a fisherman.", []),
    "one": ("What is shown in this image?", [(90, 60)]),
    "two-sizes": ("Compare the two images.", [(64, 64), (90, 60)]),
    "large": ("Describe the picture in detail.", [(400, 300)]),
}


@pytest.fixture(scope="module")
def expected(tiny_qwen3_vl_dir: Path) -> dict[str, list[int]]:
    """transformers' greedy tokens for every case."""
    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(
        tiny_qwen3_vl_dir, dtype=torch.float32
    ).eval()
    return transformers_greedy(model, load_qwen3_vl_processor(tiny_qwen3_vl_dir), CASES, MAX_TOKENS)


def _deepstack_rows(engine: LLMEngine) -> None:
    assert engine.runner.image_cache is not None
    assert engine.runner.image_cache.shape[-1] == 4 * 64  # embedding + 3 DeepStack levels


@pytest.mark.parametrize("token_budget", [512, 24])  # one prefill each; chunks cut images
def test_engine_tokens_match_transformers(tiny_qwen3_vl_dir, expected, token_budget):
    tokens, prompts = engine_greedy(
        tiny_qwen3_vl_dir, CASES, MAX_TOKENS, token_budget, check=_deepstack_rows
    )
    assert [len(p.images) for p in prompts.values()] == [0, 1, 2, 1]
    assert [i.num_tokens for i in prompts["two-sizes"].images] == [4, 6]
    assert prompts["large"].images[0].num_tokens == 108
    assert tokens == expected
    assert all(len(t) > 1 for t in tokens.values())
