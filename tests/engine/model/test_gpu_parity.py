"""The model on CUDA gives the CPU's greedy tokens (needs a GPU).

float32 on CUDA (TF32 off) must match float32 on the CPU token for token. float16 must too
on the tiny checkpoint's prompts; where a random-weight model's top two logits are closer
than float16 can resolve the test would say so in its message (the logits comparison next
to it bounds the error itself).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from epd_engine.model.generate import greedy_generate, prompt_embeddings
from epd_engine.model.loader import load_language, load_vision
from tests.engine.model.prompts import build_prompt, make_images

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def exact_float32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _generate(model_dir: Path, device: str, dtype: torch.dtype, ids: list[int], pixels: Any,
              with_image: bool) -> list[int]:  # fmt: skip
    vision = load_vision(model_dir, dtype, device) if with_image else None
    language = load_language(model_dir, dtype, device)
    return greedy_generate(vision, language, ids, pixels, max_new_tokens=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_images", [0, 1])
def test_cuda_greedy_matches_cpu_fp32(
    tiny_model_dir: Path, processor: Any, num_images: int, dtype: torch.dtype
) -> None:
    inputs = build_prompt(processor, "Describe it.", make_images()[:num_images])
    ids = inputs["input_ids"][0].tolist()
    pixels = inputs.get("pixel_values")
    cpu = _generate(tiny_model_dir, "cpu", torch.float32, ids, pixels, bool(num_images))
    cuda = _generate(tiny_model_dir, "cuda", dtype, ids, pixels, bool(num_images))
    assert cuda == cpu


def test_cuda_fp16_prefill_logits_close_to_cpu_fp32(tiny_model_dir: Path, processor: Any) -> None:
    inputs = build_prompt(processor, "Describe it.", make_images()[:1])
    ids = inputs["input_ids"][0].tolist()
    logits = []
    for device, dtype in (("cpu", torch.float32), ("cuda", torch.float16)):
        vision = load_vision(tiny_model_dir, dtype, device)
        language = load_language(tiny_model_dir, dtype, device)
        with torch.inference_mode():
            embeds = prompt_embeddings(vision, language, ids, inputs["pixel_values"])
            block_size = 16
            pages = list(range(-(-len(ids) // block_size)))
            kv = language.allocate_kv_cache(len(pages), block_size)
            from epd_engine.model.attention import AttentionBatch

            meta = language.prepare(AttentionBatch([len(ids)], [len(ids)], [pages], block_size))
            positions = torch.arange(len(ids), device=device)
            hidden = language(embeds, positions, kv, meta)
            logits.append(language.compute_logits(hidden).double().cpu())
    ref, got = logits
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2
