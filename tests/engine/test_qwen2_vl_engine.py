"""Qwen2-VL and Qwen2.5-VL through the engine (scheduler, paged image cache, chunked
prefill, batching): greedy tokens equal transformers' generate() for images of different
sizes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from epd_engine.config import EngineConfig, Role
from epd_engine.engine.llm_engine import LLMEngine
from epd_engine.inputs.images import LoadedImage
from epd_engine.inputs.processor import InputProcessor, PreparedPrompt
from epd_engine.model.qwen2_vl_processor import load_qwen2_vl_processor
from epd_engine.sampling import SamplingParams
from tests.engine.model.prompts import make_images

MAX_TOKENS = 12
# (text, image sizes): 6, 4 + 6 and 77 image tokens (several 64-token pages)
CASES: dict[str, tuple[str, list[tuple[int, int]]]] = {
    "text": ("Write a short story about a fisherman.", []),
    "one": ("What is shown in this image?", [(90, 60)]),
    "two-sizes": ("Compare the two images.", [(64, 64), (90, 60)]),
    "large": ("Describe the picture in detail.", [(300, 200)]),
}


def loaded(sizes: list[tuple[int, int]]) -> list[LoadedImage]:
    pictures = make_images()
    out = []
    for i, (w, h) in enumerate(sizes):
        image: Image.Image = pictures[i % len(pictures)].resize((w, h))
        out.append(LoadedImage(image, f"hash-{i}-{w}x{h}", w, h))
    return out


def messages(text: str, num_images: int) -> list[dict[str, Any]]:
    content = [{"type": "image"} for _ in range(num_images)] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


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
    processor = load_qwen2_vl_processor(model_dir)
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


def run_engine(model_dir: Path, token_budget: int) -> tuple[dict[str, list[int]], dict[str, Any]]:
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


@pytest.mark.parametrize("token_budget", [512, 24])  # one prefill each; chunks cut images
def test_engine_tokens_match_transformers(family, expected, token_budget):
    tokens, prompts = run_engine(family[0], token_budget)
    assert [len(p.images) for p in prompts.values()] == [0, 1, 2, 1]
    assert [i.num_tokens for i in prompts["two-sizes"].images] == [4, 6]
    assert prompts["large"].images[0].num_tokens == 77
    assert tokens == expected
    assert all(len(t) > 1 for t in tokens.values())
