"""Qwen2-VL and Qwen2.5-VL through the engine (scheduler, paged image cache, chunked
prefill, batching): greedy tokens equal transformers' generate() for images of different
sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from epd_engine.model.qwen2_vl_processor import load_qwen2_vl_processor
from tests.engine.model.engine_parity import engine_greedy, transformers_greedy

MAX_TOKENS = 12
# (text, image sizes): 6, 4 + 6 and 77 image tokens (several 64-token pages)
CASES: dict[str, tuple[str, list[tuple[int, int]]]] = {
    "text": ("Write a short story about a fisherman.", []),
    "one": ("What is shown in this image?", [(90, 60)]),
    "two-sizes": ("Compare the two images.", [(64, 64), (90, 60)]),
    "large": ("Describe the picture in detail.", [(300, 200)]),
}


FAMILIES = {  # checkpoint fixture, transformers class
    "qwen2-vl": ("tiny_qwen2_vl_dir", "Qwen2VLForConditionalGeneration"),
    "qwen2.5-vl": ("tiny_qwen2_5_vl_dir", "Qwen2_5_VLForConditionalGeneration"),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> tuple[Path, str]:
    fixture, hf_class = FAMILIES[request.param]
    return Path(request.getfixturevalue(fixture)), hf_class


@pytest.fixture(scope="module")
def expected(family: tuple[Path, str]) -> dict[str, list[int]]:
    """transformers' greedy tokens for every case."""
    import transformers

    model_dir, hf_class = family
    model = getattr(transformers, hf_class).from_pretrained(model_dir, dtype=torch.float32).eval()
    return transformers_greedy(model, load_qwen2_vl_processor(model_dir), CASES, MAX_TOKENS)


@pytest.mark.parametrize("token_budget", [512, 24])  # one prefill each; chunks cut images
def test_engine_tokens_match_transformers(family, expected, token_budget):
    tokens, prompts = engine_greedy(family[0], CASES, MAX_TOKENS, token_budget)
    assert [len(p.images) for p in prompts.values()] == [0, 1, 2, 1]
    assert [i.num_tokens for i in prompts["two-sizes"].images] == [4, 6]
    assert prompts["large"].images[0].num_tokens == 77
    assert tokens == expected
    assert all(len(t) > 1 for t in tokens.values())
