"""Our Qwen2-VL / Qwen2.5-VL vs transformers' ``Qwen2VLForConditionalGeneration`` /
``Qwen2_5_VLForConditionalGeneration`` on the tiny checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from epd_engine.model.generate import single_sequence_metadata
from epd_engine.model.generate_qwen2_vl import greedy_generate, prompt_inputs
from epd_engine.model.loader import load_language, load_vision
from epd_engine.model.qwen2_vl import Qwen2VLLanguage, Qwen2VLVision
from epd_engine.model.qwen2_vl_processor import load_qwen2_vl_processor
from epd_engine.model.registry import family_of
from tests.engine.model.prompts import build_prompt, make_images

# (text, image sizes): 90x60 -> 6 tokens, 64x64 -> 4, 300x200 -> 77 (several 16-token pages)
PROMPTS: dict[str, tuple[str, list[tuple[int, int]]]] = {
    "text-only": ("Write a short story about a fisherman.", []),
    "one-image": ("What is shown in this image?", [(90, 60)]),
    "two-sizes": ("Compare the two images.", [(90, 60), (64, 64)]),
    "large-image": ("Describe the picture in detail.", [(300, 200)]),
}


FAMILIES = {  # family -> (checkpoint fixture, transformers class)
    "qwen2-vl": ("tiny_qwen2_vl_dir", "Qwen2VLForConditionalGeneration"),
    "qwen2.5-vl": ("tiny_qwen2_5_vl_dir", "Qwen2_5_VLForConditionalGeneration"),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def qwen_dir(request: pytest.FixtureRequest, family_name: str) -> Path:
    return Path(request.getfixturevalue(FAMILIES[family_name][0]))


def hf_class(family_name: str) -> Any:
    import transformers

    return getattr(transformers, FAMILIES[family_name][1])


@pytest.fixture(scope="module")
def qwen_processor(qwen_dir: Path) -> Any:
    return load_qwen2_vl_processor(qwen_dir)


@pytest.fixture(scope="module")
def hf_qwen(qwen_dir: Path, family_name: str) -> Any:
    return hf_class(family_name).from_pretrained(qwen_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def qwen_vision(qwen_dir: Path) -> Qwen2VLVision:
    return load_vision(qwen_dir, torch.float32, "cpu")


@pytest.fixture(scope="module")
def qwen_language(qwen_dir: Path) -> Qwen2VLLanguage:
    return load_language(qwen_dir, torch.float32, "cpu")


def images_of(sizes: list[tuple[int, int]]) -> list[Image.Image]:
    pictures = make_images()
    return [pictures[i % len(pictures)].resize(size) for i, size in enumerate(sizes)]


@pytest.fixture(scope="module", params=list(PROMPTS))
def inputs(request: pytest.FixtureRequest, qwen_processor: Any) -> dict[str, Any]:
    text, sizes = PROMPTS[request.param]
    return build_prompt(qwen_processor, text, images_of(sizes))


def grids_of(inputs: dict[str, Any]) -> list[tuple[int, int, int]]:
    grid = inputs.get("image_grid_thw")
    return [] if grid is None else [tuple(int(v) for v in row) for row in grid]  # type: ignore[misc]


def test_the_family_is_found_and_transformers_loads_every_tensor(qwen_dir, family_name):
    assert family_of(qwen_dir).name == family_name
    _, info = hf_class(family_name).from_pretrained(
        qwen_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info


def test_image_token_counts_follow_the_resolution(qwen_dir, qwen_processor, qwen_language):
    rule = family_of(qwen_dir).image_tokens(qwen_dir, qwen_language.config)
    image_token = qwen_language.config.image_token_index
    counts = []
    for size in [(90, 60), (64, 64), (300, 200), (28, 28), (2000, 1000)]:
        encoded = build_prompt(qwen_processor, "Describe.", images_of([size]))
        counts.append(int((encoded["input_ids"] == image_token).sum()))
        assert counts[-1] == rule(*size), size
    assert counts == [6, 4, 77, 4, 242]  # 28x28 up to min_pixels; 2000x1000 down under 448^2


def test_prefill_logits_match_transformers(inputs, qwen_vision, qwen_language, hf_qwen):
    input_ids = inputs["input_ids"][0].tolist()
    embeds, positions, _ = prompt_inputs(
        qwen_vision, qwen_language, input_ids, inputs.get("pixel_values"), grids_of(inputs)
    )
    num_blocks = -(-len(input_ids) // 16)
    meta = single_sequence_metadata(list(range(num_blocks)), 0, len(input_ids), 16)
    kv_caches = qwen_language.allocate_kv_cache(num_blocks, 16)
    with torch.inference_mode():
        ours = qwen_language.compute_logits(qwen_language(embeds, positions, kv_caches, meta))
        theirs = hf_qwen(**inputs).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    top2 = ours[-1].topk(2).values
    assert ours[-1].std() > 1.0 and top2[0] - top2[1] > 1e-3


def test_greedy_generate_matches_transformers(inputs, qwen_vision, qwen_language, hf_qwen):
    input_ids = inputs["input_ids"][0].tolist()
    ours = greedy_generate(
        qwen_vision, qwen_language, input_ids, inputs.get("pixel_values"), grids_of(inputs), 24
    )
    with torch.inference_mode():
        generated = hf_qwen.generate(**inputs, max_new_tokens=24, do_sample=False)
    assert ours == generated[0, len(input_ids) :].tolist()
    assert len(ours) > 1


def test_mrope_positions_change_the_output(qwen_processor, qwen_vision, qwen_language):
    """With 1-D positions the logits differ: the three streams are really used."""
    inputs = build_prompt(qwen_processor, "Describe.", images_of([(300, 200)]))
    input_ids = inputs["input_ids"][0].tolist()
    embeds, positions, delta = prompt_inputs(
        qwen_vision, qwen_language, input_ids, inputs["pixel_values"], grids_of(inputs)
    )
    assert delta < 0  # a 7x11 image spans 11 positions, not 77
    meta = single_sequence_metadata([0, 1, 2, 3, 4, 5, 6, 7], 0, len(input_ids), 16)
    results = []
    for pos in (positions, torch.arange(len(input_ids))):
        kv_caches = qwen_language.allocate_kv_cache(8, 16)
        with torch.inference_mode():
            hidden = qwen_language(embeds, pos, kv_caches, meta)
            results.append(qwen_language.compute_logits(hidden[-1:]))
    assert not torch.allclose(results[0], results[1], atol=1e-2)
