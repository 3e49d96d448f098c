"""The largest image a checkpoint takes, and a deployment's lower ``max_pixels`` (issue 31):
the processor, the token rule and M-RoPE all resize by the same bound, and a bound that
cannot apply is refused at start-up, naming why."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from epd_engine.contracts.image_grid import smart_resize
from epd_engine.inputs.images import LoadedImage
from epd_engine.inputs.processor import InputProcessor
from epd_engine.model.image_bounds import largest_image_tokens, with_max_pixels
from epd_engine.model.model_config import LlavaModelConfig
from epd_engine.model.registry import family_of, load_model_config

LOWERED = 112 * 112  # tiny-qwen2-vl allows 448 x 448


def test_the_largest_image_comes_from_the_checkpoint(
    tiny_qwen2_vl_dir: Path, tiny_model_dir: Path
) -> None:
    config = load_model_config(tiny_qwen2_vl_dir)
    assert largest_image_tokens(tiny_qwen2_vl_dir, config) == 448 * 448 // (28 * 28)
    lowered = with_max_pixels(tiny_qwen2_vl_dir, config, LOWERED)
    assert largest_image_tokens(tiny_qwen2_vl_dir, lowered) == 16
    llava = load_model_config(tiny_model_dir)
    assert isinstance(llava, LlavaModelConfig)
    assert largest_image_tokens(tiny_model_dir, llava) == llava.num_image_tokens


def test_a_bound_that_cannot_apply_is_refused(
    tiny_qwen2_vl_dir: Path, tiny_model_dir: Path
) -> None:
    config = load_model_config(tiny_qwen2_vl_dir)
    with pytest.raises(
        ValueError, match=r"within the checkpoint's processor bounds \[3136, 200704\]"
    ):
        with_max_pixels(tiny_qwen2_vl_dir, config, 449 * 449)
    with pytest.raises(ValueError, match="applies to dynamic-resolution models"):
        with_max_pixels(tiny_model_dir, load_model_config(tiny_model_dir), LOWERED)


def test_processor_token_rule_and_rope_resize_alike(tiny_qwen2_vl_dir: Path) -> None:
    config = with_max_pixels(tiny_qwen2_vl_dir, load_model_config(tiny_qwen2_vl_dir), LOWERED)
    processor = InputProcessor(tiny_qwen2_vl_dir, config)
    image = Image.new("RGB", (300, 200), (10, 200, 30))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    # the processor's own count is checked against the token rule inside prepare
    prompt = processor.prepare(messages, [LoadedImage(image, "h", 300, 200)])
    height, width = smart_resize(200, 300, 28, 56 * 56, LOWERED)
    assert prompt.images[0].num_tokens == height * width // (28 * 28) < 77  # 77: unlowered
    rope = family_of(tiny_qwen2_vl_dir).rope
    assert rope is not None
    state = rope(tiny_qwen2_vl_dir, config)(prompt.token_ids, prompt.images)
    assert state is not None
