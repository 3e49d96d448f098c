"""Gemma 3 through the engine (scheduler, image cache, chunked prefill, batching): greedy
tokens equal transformers' generate(), with prompts longer than the sliding window and,
at a small token budget, chunk ends that would fall inside an image (the scheduler keeps
each image whole: its tokens attend to each other both ways)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from epd_engine.config import EngineConfig, Role
from epd_engine.engine.llm_engine import LLMEngine
from epd_engine.inputs.processor import InputProcessor, PreparedPrompt
from epd_engine.model.gemma3_processor import load_gemma3_processor
from epd_engine.sampling import SamplingParams
from tests.engine.test_qwen2_vl_engine import loaded, messages

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
    processor = load_gemma3_processor(tiny_gemma3_dir)
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


@pytest.mark.parametrize("token_budget", [512, 12])  # one prefill each; chunks meet images
def test_engine_tokens_match_transformers(tiny_gemma3_dir, expected, token_budget):
    tokens, prompts = run_engine(tiny_gemma3_dir, token_budget)
    assert [[i.num_tokens for i in p.images] for p in prompts.values()] == [[], [16], [16, 16]]
    assert all(len(p.token_ids) > 16 for p in prompts.values())  # past the window
    assert tokens == expected
    assert all(len(t) > 1 for t in tokens.values())
