"""Our Gemma 3 vs transformers' ``Gemma3ForConditionalGeneration`` on the tiny checkpoint:
sliding-window layers (window 16) beside global ones, the local and (linearly scaled)
global rotary bases, pooled SigLIP image tokens and bidirectional attention over them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from epd_engine.model.attention import AttentionBatch
from epd_engine.model.gemma3 import Gemma3Language, Gemma3Vision
from epd_engine.model.generate_gemma3 import greedy_generate, prompt_embeds
from epd_engine.model.image_spans import image_spans
from epd_engine.model.loader import load_language, load_vision
from epd_engine.model.registry import family_of
from tests.engine.model.prompts import build_prompt, make_images

LONG_TEXT = (
    "Tell me about the fisherman who sailed out every morning before dawn, how he mended "
    "his nets, what the harbour looked like in winter and why he never sold his boat."
)
# (text, images): every prompt but the first is longer than the 16-token window
PROMPTS: dict[str, tuple[str, int]] = {
    "text-only": ("Hi.", 0),
    "long-text": (LONG_TEXT, 0),
    "one-image": ("What is shown in this image?", 1),
    "two-images": ("Compare the two images.", 2),
}


@pytest.fixture(scope="module")
def processor(tiny_gemma3_dir: Path) -> Any:
    return family_of(tiny_gemma3_dir).processor(tiny_gemma3_dir)


@pytest.fixture(scope="module")
def hf_model(tiny_gemma3_dir: Path) -> Any:
    from transformers import Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration.from_pretrained(
        tiny_gemma3_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def vision(tiny_gemma3_dir: Path) -> Gemma3Vision:
    return load_vision(tiny_gemma3_dir, torch.float32, "cpu")


@pytest.fixture(scope="module")
def language(tiny_gemma3_dir: Path) -> Gemma3Language:
    return load_language(tiny_gemma3_dir, torch.float32, "cpu")


@pytest.fixture(scope="module", params=list(PROMPTS))
def inputs(request: pytest.FixtureRequest, processor: Any) -> dict[str, Any]:
    text, num_images = PROMPTS[request.param]
    return build_prompt(processor, text, make_images()[:num_images])


def prefill_logits(
    language: Gemma3Language,
    vision: Gemma3Vision,
    inputs: dict[str, Any],
    bidirectional: bool = True,
    block_size: int = 8,
) -> torch.Tensor:
    input_ids = inputs["input_ids"][0].tolist()
    embeds = prompt_embeds(vision, language, input_ids, inputs.get("pixel_values"))
    spans = [image_spans(input_ids, language.config.image_token_index)] if bidirectional else None
    num_blocks = -(-len(input_ids) // block_size)
    table = list(range(num_blocks))
    meta = language.prepare(
        AttentionBatch([len(input_ids)], [len(input_ids)], [table], block_size, spans)
    )
    kv_caches = language.allocate_kv_cache(num_blocks, block_size)
    with torch.inference_mode():
        hidden = language(embeds, torch.arange(len(input_ids)), kv_caches, meta)
        return language.compute_logits(hidden)


def test_the_family_is_found_and_transformers_loads_every_tensor(tiny_gemma3_dir):
    from transformers import Gemma3ForConditionalGeneration

    assert family_of(tiny_gemma3_dir).name == "gemma3"
    _, info = Gemma3ForConditionalGeneration.from_pretrained(
        tiny_gemma3_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info


def test_layers_alternate_sliding_and_global(language, hf_model):
    assert language.config.layer_windows == (16, None, 16, None)
    assert hf_model.config.text_config.layer_types == [
        "sliding_attention", "full_attention", "sliding_attention", "full_attention",
    ]  # fmt: skip


def test_every_image_is_a_fixed_number_of_tokens(tiny_gemma3_dir, processor, language):
    rule = family_of(tiny_gemma3_dir).image_tokens(tiny_gemma3_dir, language.config)
    image_token = language.config.image_token_index
    for image in make_images():
        encoded = build_prompt(processor, "Describe.", [image])
        assert int((encoded["input_ids"] == image_token).sum()) == rule(*image.size) == 16


def test_prompts_are_longer_than_the_window(processor):
    for name, (text, num_images) in PROMPTS.items():
        length = build_prompt(processor, text, make_images()[:num_images])["input_ids"].shape[1]
        assert (length > 16) == (name != "text-only"), (name, length)


def test_prefill_logits_match_transformers(inputs, vision, language, hf_model):
    ours = prefill_logits(language, vision, inputs)
    with torch.inference_mode():
        theirs = hf_model(**inputs).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    top2 = ours[-1].topk(2).values
    assert ours[-1].std() > 1.0 and top2[0] - top2[1] > 1e-3


def test_greedy_generate_matches_transformers(inputs, vision, language, hf_model):
    input_ids = inputs["input_ids"][0].tolist()
    ours = greedy_generate(vision, language, input_ids, inputs.get("pixel_values"), 24)
    with torch.inference_mode():
        generated = hf_model.generate(**inputs, max_new_tokens=24, do_sample=False)
    assert ours == generated[0, len(input_ids) :].tolist()
    assert len(ours) > 1


def test_the_window_and_the_image_spans_change_the_output(processor, vision, language):
    """Neither mask is a no-op here: all-global layers, or causal image tokens, read the
    prompt differently (so the parity above really checks both)."""
    inputs = build_prompt(processor, "What is shown in this image?", make_images()[:1])
    with_both = prefill_logits(language, vision, inputs)
    causal_images = prefill_logits(language, vision, inputs, bidirectional=False)
    assert not torch.allclose(with_both[-1], causal_images[-1], atol=1e-3)
    windows = [layer.self_attn.window for layer in language.layers]
    try:
        for layer in language.layers:
            layer.self_attn.window = None
        all_global = prefill_logits(language, vision, inputs)
    finally:
        for layer, window in zip(language.layers, windows, strict=True):
            layer.self_attn.window = window
    assert not torch.allclose(with_both[-1], all_global[-1], atol=1e-3)
