"""Our LLaVA vs transformers' LlavaForConditionalGeneration on the same tiny checkpoint."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from epd_engine.model.generate import greedy_generate, prompt_embeddings, single_sequence_metadata
from epd_engine.model.llava import LlavaLanguage, LlavaVision
from tests.engine.model.prompts import build_prompt, make_images

PROMPTS = {
    "text-only": ("Write a short story about a fisherman.", 0),
    "one-image": ("What is shown in this image?", 1),
    "two-images": ("Compare the two images.", 2),
}


def our_prefill_logits(
    vision: LlavaVision, language: LlavaLanguage, inputs: dict[str, Any]
) -> torch.Tensor:  # [T, V]
    input_ids = inputs["input_ids"][0].tolist()
    embeds = prompt_embeddings(vision, language, input_ids, inputs.get("pixel_values"))
    block_size = 16
    num_blocks = -(-len(input_ids) // block_size)
    meta = single_sequence_metadata(list(range(num_blocks)), 0, len(input_ids), block_size)
    kv_caches = language.allocate_kv_cache(num_blocks, block_size)
    with torch.inference_mode():
        hidden = language(embeds, torch.arange(len(input_ids)), kv_caches, meta)
        return language.compute_logits(hidden)


@pytest.fixture(scope="module", params=list(PROMPTS))
def prompt_inputs(request: pytest.FixtureRequest, processor: Any) -> dict[str, Any]:
    text, num_images = PROMPTS[request.param]
    return build_prompt(processor, text, make_images()[:num_images])


def test_processor_expands_each_image_to_its_tokens(prompt_inputs: dict[str, Any], language):
    config = language.config
    num_images = 0 if "pixel_values" not in prompt_inputs else len(prompt_inputs["pixel_values"])
    num_placeholders = int((prompt_inputs["input_ids"] == config.image_token_index).sum())
    assert num_placeholders == num_images * config.num_image_tokens == num_images * 16


def test_prefill_logits_match_transformers(prompt_inputs, vision, language, hf_model):
    ours = our_prefill_logits(vision, language, prompt_inputs)  # [T, V]
    with torch.inference_mode():
        theirs = hf_model(**prompt_inputs).logits[0]  # [T, V]
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    # Logits are spread out (argmax decided by weights, not rounding) and differ by position.
    top2 = ours[-1].topk(2).values
    assert ours[-1].std() > 1.0 and top2[0] - top2[1] > 1e-3
    assert not torch.allclose(ours[-1], ours[-2], atol=1e-2)


def test_greedy_generate_matches_transformers(prompt_inputs, vision, language, hf_model):
    input_ids = prompt_inputs["input_ids"][0].tolist()
    ours = greedy_generate(vision, language, input_ids, prompt_inputs.get("pixel_values"), 20)
    with torch.inference_mode():
        generated = hf_model.generate(**prompt_inputs, max_new_tokens=20, do_sample=False)
    theirs = generated[0, len(input_ids) :].tolist()
    assert ours == theirs
    assert len(ours) > 1


def test_images_change_the_output(vision, language, processor):
    """Different images must give different logits (the image embeddings are really used)."""
    images = make_images()
    first = our_prefill_logits(vision, language, build_prompt(processor, "Describe.", images[:1]))
    second = our_prefill_logits(vision, language, build_prompt(processor, "Describe.", images[1:2]))
    assert not torch.allclose(first[-1], second[-1], atol=1e-2)
