"""Qwen3-VL through the engine (scheduler, paged image cache with DeepStack rows, chunked
prefill, batching): greedy tokens equal transformers' generate() for images of different
sizes, including one whose rows span several image-cache pages and prefill chunks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from epd_engine.config import EngineConfig, Role
from epd_engine.engine.llm_engine import LLMEngine
from epd_engine.inputs.processor import InputProcessor, PreparedPrompt
from epd_engine.model.qwen3_vl_processor import load_qwen3_vl_processor
from epd_engine.sampling import SamplingParams
from tests.engine.test_qwen2_vl_engine import loaded, messages

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
    processor = load_qwen3_vl_processor(tiny_qwen3_vl_dir)
    out = {}
    for name, (text, sizes) in CASES.items():
        prompt = processor.apply_chat_template(
            messages(text, len(sizes)), add_generation_prompt=True
        )
        images = [i.image for i in loaded(sizes)] or None
        inputs = processor(text=prompt, images=images, return_tensors="pt")
        with torch.inference_mode():
            generated = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        out[name] = generated[0, inputs["input_ids"].shape[1] :].tolist()
    return out


def run_engine(model_dir: Path, token_budget: int) -> tuple[dict[str, list[int]], dict]:
    engine = LLMEngine(
        EngineConfig(
            model_dir=model_dir,
            role=Role.EPD,
            token_budget=token_budget,
            image_budget=2,
            num_kv_blocks=64,
            num_image_blocks=16,
        )
    )
    assert engine.runner.image_cache is not None
    assert engine.runner.image_cache.shape[-1] == 4 * 64  # embedding + 3 DeepStack levels
    processor = InputProcessor(model_dir, engine.model_config)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    prompts: dict[str, PreparedPrompt] = {}
    for name, (text, sizes) in CASES.items():
        prompts[name] = processor.prepare(messages(text, len(sizes)), loaded(sizes))
        engine.add_request(name, prompts[name], params, processor.eos_token_ids)
    tokens: dict[str, list[int]] = {name: [] for name in CASES}
    while engine.has_work():
        events, _ = engine.step()
        for event in events:
            if event.new_token_id is not None:
                tokens[event.request_id].append(event.new_token_id)
    return tokens, prompts


@pytest.mark.parametrize("token_budget", [512, 24])  # one prefill each; chunks cut images
def test_engine_tokens_match_transformers(tiny_qwen3_vl_dir, expected, token_budget):
    tokens, prompts = run_engine(tiny_qwen3_vl_dir, token_budget)
    assert [len(p.images) for p in prompts.values()] == [0, 1, 2, 1]
    assert [i.num_tokens for i in prompts["two-sizes"].images] == [4, 6]
    assert prompts["large"].images[0].num_tokens == 108
    assert tokens == expected
    assert all(len(t) > 1 for t in tokens.values())
