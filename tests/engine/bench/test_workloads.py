from __future__ import annotations

import numpy as np
import pytest

from epd_engine.workload.arrivals import ArrivalSpec
from epd_engine.workload.generators import (
    WORKLOADS,
    describe_workloads,
    generate,
    random_mm,
    synthesize,
)
from epd_engine.workload.image_tokens import llava_1_5, llava_next, qwen2_vl, qwen3_vl


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_length_means_match_the_documented_shape(name: str) -> None:
    shape = WORKLOADS[name]
    records = generate(name, 3000, seed=7)
    prompt = np.mean([r.prompt_tokens for r in records])
    output = np.mean([r.output_tokens for r in records])
    assert prompt == pytest.approx(shape.prompt_tokens.mean, rel=0.06)
    assert output == pytest.approx(shape.output_tokens.mean, rel=0.08)
    text_only = np.mean([r.text_only for r in records])
    assert text_only == pytest.approx(shape.text_only_fraction, abs=0.04)


def test_generation_is_deterministic_in_the_seed() -> None:
    assert generate("textvqa", 50, seed=3) == generate("textvqa", 50, seed=3)
    assert generate("textvqa", 50, seed=3) != generate("textvqa", 50, seed=4)


def test_shared_pictures_reuse_hash_and_size() -> None:
    records = generate("pope", 600, seed=1)  # POPE: 6 questions per image
    images = [i for r in records for i in r.images]
    by_hash: dict[str, set[tuple[int, int]]] = {}
    for image in images:
        by_hash.setdefault(image.hash, set()).add((image.width, image.height))
    assert len(by_hash) == 100
    assert all(len(sizes) == 1 for sizes in by_hash.values())
    assert len({i.hash for r in generate("vizwiz", 200) for i in r.images}) == 200


def test_text_only_override_makes_mixed_traffic() -> None:
    records = generate("textcaps", 2000, seed=2, text_only_fraction=0.3)
    assert np.mean([r.text_only for r in records]) == pytest.approx(0.3, abs=0.04)
    assert all(r.images == () for r in records if r.text_only)


def test_epd_serve_shapes() -> None:
    vwi = generate("visualwebinstruct", 2000, seed=0)
    assert {(i.width, i.height) for r in vwi for i in r.images} == {(1280, 720)}
    assert {r.output_tokens for r in vwi} == {64}
    s4o = [i for r in generate("sharegpt4o", 3000, seed=0) for i in r.images]
    assert np.mean([i.width for i in s4o]) == pytest.approx(802, rel=0.03)
    assert np.mean([i.height for i in s4o]) == pytest.approx(652, rel=0.03)


def test_random_mm_items_and_lengths() -> None:
    shape = random_mm(input_len=2000, output_len=150, base_items_per_request=4)
    records = generate(shape, 100, image_tokenizer="qwen3-vl")
    assert {r.prompt_tokens for r in records} == {2000}
    assert {r.num_images for r in records} == {4}
    assert {i.tokens for r in records for i in r.images} == {400}  # 640x640, vLLM post
    spread = generate(random_mm(base_items_per_request=2, num_items_range_ratio=0.5), 500)
    assert {r.num_images for r in spread} == {1, 2, 3}
    ranged = generate(random_mm(input_len=400, range_ratio=0.25), 500)
    assert (
        min(r.prompt_tokens for r in ranged) >= 300 and max(r.prompt_tokens for r in ranged) <= 500
    )


def test_image_token_models_match_published_numbers() -> None:
    # EPD-Serve's E->P transfer table (Qwen2-VL-style 28-px tokens).
    for (height, width), tokens in {
        (280, 280): 100,
        (560, 560): 400,
        (720, 1280): 1196,
        (1080, 1920): 2691,
        (4096, 3112): 16206,
    }.items():
        assert qwen2_vl(width, height) == tokens
    assert llava_1_5(1920, 1080) == 576  # HydraInfer: 576 per image
    assert qwen3_vl(640, 640) == 400  # vLLM post: ~400 per 640x640 image
    assert llava_next(336, 336) == 1152 and llava_next(4000, 3000) == 2880


def test_synthesize_attaches_arrivals_and_unknown_names_fail() -> None:
    records = synthesize("mme", 200, ArrivalSpec("uniform", 4.0))
    assert [r.arrival_s for r in records[:3]] == [0.0, 0.25, 0.5]
    with pytest.raises(ValueError, match="unknown workload"):
        generate("coco", 1)
    with pytest.raises(ValueError, match="unknown model family"):
        generate("mme", 1, image_tokenizer="gpt")
    assert {row["name"] for row in describe_workloads()} == set(WORKLOADS)
    assert all(row["source"] for row in describe_workloads())
