"""The same model on CUDA in float16 gives the CPU float32 greedy tokens (needs a GPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from epd_engine.model.generate import greedy_generate
from epd_engine.model.loader import load_language, load_vision
from tests.engine.model.prompts import build_prompt, make_images

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("num_images", [0, 1])
def test_cuda_fp16_greedy_matches_cpu_fp32(
    tiny_model_dir: Path, processor: Any, num_images: int
) -> None:
    inputs = build_prompt(processor, "Describe it.", make_images()[:num_images])
    ids = inputs["input_ids"][0].tolist()
    pixels = inputs.get("pixel_values")
    outputs = []
    for device, dtype in (("cpu", torch.float32), ("cuda", torch.float16)):
        vision = load_vision(tiny_model_dir, dtype, device) if num_images else None
        language = load_language(tiny_model_dir, dtype, device)
        outputs.append(greedy_generate(vision, language, ids, pixels, max_new_tokens=16))
    assert outputs[0] == outputs[1]
