"""Our Qwen3-VL vs transformers' ``Qwen3VLForConditionalGeneration`` on the tiny checkpoint:
DeepStack levels, interleaved M-RoPE and the interpolated position embeddings included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from epd_engine.model.deepstack import DeepStackRows
from epd_engine.model.generate import single_sequence_metadata
from epd_engine.model.generate_qwen2_vl import greedy_generate, prompt_rows
from epd_engine.model.loader import load_language, load_vision
from epd_engine.model.qwen3_vl import Qwen3VLLanguage, Qwen3VLVision
from epd_engine.model.qwen3_vl_processor import load_qwen3_vl_processor
from epd_engine.model.registry import family_of
from tests.engine.model.prompts import build_prompt
from tests.engine.model.test_qwen2_vl_parity import grids_of, images_of

# (text, image sizes): 90x60 -> 6 tokens, 64x64 -> 4, 400x300 -> 108 (two 64-token pages)
PROMPTS: dict[str, tuple[str, list[tuple[int, int]]]] = {
    "text-only": ("Write a short story about a fisherman.", []),
    "one-image": ("What is shown in this image?", [(90, 60)]),
    "two-sizes": ("Compare the two images.", [(90, 60), (64, 64)]),
    "multi-page-image": ("Describe the picture in detail.", [(400, 300)]),
}


@pytest.fixture(scope="module")
def processor(tiny_qwen3_vl_dir: Path) -> Any:
    return load_qwen3_vl_processor(tiny_qwen3_vl_dir)


@pytest.fixture(scope="module")
def hf_model(tiny_qwen3_vl_dir: Path) -> Any:
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(
        tiny_qwen3_vl_dir, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def vision(tiny_qwen3_vl_dir: Path) -> Qwen3VLVision:
    return load_vision(tiny_qwen3_vl_dir, torch.float32, "cpu")


@pytest.fixture(scope="module")
def language(tiny_qwen3_vl_dir: Path) -> Qwen3VLLanguage:
    return load_language(tiny_qwen3_vl_dir, torch.float32, "cpu")


@pytest.fixture(scope="module", params=list(PROMPTS))
def inputs(request: pytest.FixtureRequest, processor: Any) -> dict[str, Any]:
    text, sizes = PROMPTS[request.param]
    return build_prompt(processor, text, images_of(sizes))


def prefill_logits(
    language: Qwen3VLLanguage, inputs: dict[str, Any], vision: Qwen3VLVision, keep_levels=True
) -> torch.Tensor:
    input_ids = inputs["input_ids"][0].tolist()
    embeds, positions, _, deepstack = prompt_rows(
        vision, language, input_ids, inputs.get("pixel_values"), grids_of(inputs)
    )
    if deepstack is not None and not keep_levels:
        deepstack = DeepStackRows(deepstack.rows, torch.zeros_like(deepstack.features))
    num_blocks = -(-len(input_ids) // 16)
    meta = single_sequence_metadata(list(range(num_blocks)), 0, len(input_ids), 16)
    kv_caches = language.allocate_kv_cache(num_blocks, 16)
    with torch.inference_mode():
        hidden = language(embeds, positions, kv_caches, meta, None, deepstack)
        return language.compute_logits(hidden)


def test_the_family_is_found_and_transformers_loads_every_tensor(tiny_qwen3_vl_dir):
    from transformers import Qwen3VLForConditionalGeneration

    assert family_of(tiny_qwen3_vl_dir).name == "qwen3-vl"
    _, info = Qwen3VLForConditionalGeneration.from_pretrained(
        tiny_qwen3_vl_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info


def test_image_token_counts_follow_the_resolution(tiny_qwen3_vl_dir, processor, language):
    rule = family_of(tiny_qwen3_vl_dir).image_tokens(tiny_qwen3_vl_dir, language.config)
    image_token = language.config.image_token_index
    counts = []
    for size in [(90, 60), (64, 64), (400, 300), (32, 32), (2000, 1000)]:
        encoded = build_prompt(processor, "Describe.", images_of([size]))
        counts.append(int((encoded["input_ids"] == image_token).sum()))
        assert counts[-1] == rule(*size), size
    # one token per 32x32 px; 32x32 up to min_pixels (64x64); 2000x1000 down under 512^2
    assert counts == [6, 4, 108, 4, 242]


def test_vision_rows_hold_the_embedding_and_every_deepstack_level(processor, vision):
    inputs = build_prompt(processor, "Compare.", images_of([(90, 60), (400, 300)]))
    grids = grids_of(inputs)
    patches = inputs["pixel_values"].split([t * h * w for t, h, w in grids])
    rows = vision.encode_images(
        [p.view(h, w, -1) for p, (_, h, w) in zip(patches, grids, strict=True)]
    )
    assert [tuple(r.shape) for r in rows] == [(6, 4 * 64), (108, 4 * 64)]
    assert vision.config.image_row_size == 4 * 64


def test_prefill_logits_match_transformers(inputs, vision, language, hf_model):
    ours = prefill_logits(language, inputs, vision)
    with torch.inference_mode():
        theirs = hf_model(**inputs).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    top2 = ours[-1].topk(2).values
    assert ours[-1].std() > 1.0 and top2[0] - top2[1] > 1e-3


def test_greedy_generate_matches_transformers(inputs, vision, language, hf_model):
    input_ids = inputs["input_ids"][0].tolist()
    ours = greedy_generate(
        vision, language, input_ids, inputs.get("pixel_values"), grids_of(inputs), 24
    )
    with torch.inference_mode():
        generated = hf_model.generate(**inputs, max_new_tokens=24, do_sample=False)
    assert ours == generated[0, len(input_ids) :].tolist()
    assert len(ours) > 1


def test_deepstack_levels_change_the_output(processor, vision, language):
    """Without its DeepStack features an image reads differently: the levels are really
    used, so a hand-off that dropped them would not match one instance's tokens."""
    inputs = build_prompt(processor, "Describe.", images_of([(400, 300)]))
    with_levels = prefill_logits(language, inputs, vision)
    without = prefill_logits(language, inputs, vision, keep_levels=False)
    assert not torch.allclose(with_levels[-1], without[-1], atol=1e-2)
