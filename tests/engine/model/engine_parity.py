"""What the engine-vs-transformers parity tests share: the cases' messages and images,
transformers' greedy tokens, and one engine's greedy tokens for the same prompts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from epd_engine.config import EngineConfig, Role
from epd_engine.engine.llm_engine import LLMEngine
from epd_engine.inputs.images import LoadedImage
from epd_engine.inputs.processor import InputProcessor, PreparedPrompt
from epd_engine.sampling import SamplingParams
from tests.engine.model.prompts import make_images

Cases = dict[str, tuple[str, list[tuple[int, int]]]]  # name -> (text, image sizes)


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


def transformers_greedy(model: Any, processor: Any, cases: Cases, max_tokens: int) -> dict:
    """``model.generate``'s greedy new tokens for every case, prompts by ``processor``."""
    out = {}
    for name, (text, sizes) in cases.items():
        prompt = processor.apply_chat_template(
            messages(text, len(sizes)), add_generation_prompt=True
        )
        images = [i.image for i in loaded(sizes)] or None
        inputs = processor(text=prompt, images=images, return_tensors="pt")
        with torch.inference_mode():
            generated = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
        out[name] = generated[0, inputs["input_ids"].shape[1] :].tolist()
    return out


def engine_greedy(
    model_dir: Path,
    cases: Cases,
    max_tokens: int,
    token_budget: int,
    check: Callable[[LLMEngine], None] = lambda engine: None,
    device: str = "cpu",
    dtype: str = "float32",
    tensor_parallel_size: int = 1,
) -> tuple[dict[str, list[int]], dict[str, PreparedPrompt]]:
    """One EPD engine's greedy tokens for every case, all requests batched together;
    ``check`` sees the engine once it is built."""
    engine = LLMEngine(
        EngineConfig(
            model_dir=model_dir,
            role=Role.EPD,
            token_budget=token_budget,
            image_budget=2,
            num_kv_blocks=64,
            num_image_blocks=16,
            device=device,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
        )
    )
    try:
        return _greedy(engine, model_dir, cases, max_tokens, check)
    finally:
        engine.close()


def _greedy(
    engine: LLMEngine,
    model_dir: Path,
    cases: Cases,
    max_tokens: int,
    check: Callable[[LLMEngine], None],
) -> tuple[dict[str, list[int]], dict[str, PreparedPrompt]]:
    check(engine)
    processor = InputProcessor(model_dir, engine.model_config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    prompts: dict[str, PreparedPrompt] = {}
    for name, (text, sizes) in cases.items():
        prompts[name] = processor.prepare(messages(text, len(sizes)), loaded(sizes))
        engine.add_request(name, prompts[name], params, processor.eos_token_ids)
    tokens: dict[str, list[int]] = {name: [] for name in cases}
    while engine.has_work():
        events, _ = engine.step()
        for event in events:
            if event.new_token_id is not None:
                tokens[event.request_id].append(event.new_token_id)
    return tokens, prompts
