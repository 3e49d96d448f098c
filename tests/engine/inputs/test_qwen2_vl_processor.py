"""The Qwen2-VL input processor: per-image tokens and grids, and bad input as client errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from PIL import Image

from epd_engine.contracts.errors import ClientError
from epd_engine.inputs.images import LoadedImage
from epd_engine.inputs.processor import InputProcessor
from epd_engine.model.registry import load_model_config


@pytest.fixture(scope="module")
def processor(tiny_qwen2_vl_dir: Path) -> InputProcessor:
    return InputProcessor(tiny_qwen2_vl_dir, load_model_config(tiny_qwen2_vl_dir))


def image(width: int, height: int) -> LoadedImage:
    return LoadedImage(
        Image.new("RGB", (width, height), (10, 200, 30)), f"{width}x{height}", width, height
    )


def test_each_image_reports_its_tokens_and_patch_grid(processor):
    content = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare."}]
    prompt = processor.prepare(
        [{"role": "user", "content": content}], [image(300, 200), image(64, 48)]
    )
    assert [(i.num_tokens, i.width, i.height) for i in prompt.images] == [
        (77, 300, 200),
        (4, 64, 48),
    ]
    assert [tuple(p.shape) for p in prompt.pixel_values] == [(14, 22, 1176), (4, 4, 1176)]
    image_id = processor.model_config.image_token_index
    for ref in prompt.images:  # each image's placeholders are one run at its offset
        assert (
            prompt.token_ids[ref.offset : ref.offset + ref.num_tokens]
            == [image_id] * ref.num_tokens
        )
    assert prompt.token_ids.count(image_id) == 81


@pytest.mark.parametrize("num_images", [0, 1])
def test_image_token_in_text_is_a_client_error(processor, num_images):
    content = [{"type": "image"}] * num_images + [{"type": "text", "text": "see <|image_pad|>"}]
    with pytest.raises(
        ClientError, match=re.escape("do not put the image token '<|image_pad|>' in text")
    ):
        processor.prepare([{"role": "user", "content": content}], [image(90, 60)] * num_images)
