"""The model registry: a checkpoint's architecture picks its family, or a clear error."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from epd_engine.contracts.image_grid import smart_resize
from epd_engine.model.loader import load_language
from epd_engine.model.model_config import LlavaModelConfig, ModelFormatError
from epd_engine.model.registry import (
    GEMMA3,
    LLAVA,
    QWEN2_VL,
    QWEN3_VL,
    family_for,
    family_of,
    family_of_preset,
    load_model_config,
)


def test_family_by_architecture_then_model_type():
    assert family_for({"architectures": ["LlavaForConditionalGeneration"]}) is LLAVA
    assert family_for({"architectures": ["Qwen2VLForConditionalGeneration"]}) is QWEN2_VL
    assert family_for({"model_type": "qwen2_vl"}) is QWEN2_VL
    assert family_for({"architectures": ["Qwen3VLForConditionalGeneration"]}) is QWEN3_VL
    assert family_for({"model_type": "qwen3_vl"}) is QWEN3_VL
    assert family_for({"architectures": ["Gemma3ForConditionalGeneration"]}) is GEMMA3
    assert family_for({"model_type": "gemma3"}) is GEMMA3


def test_unknown_architecture_names_the_supported_ones(tiny_model_dir, tmp_path):
    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "mllama")
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["MllamaForConditionalGeneration"]
    (model_dir / "config.json").write_text(json.dumps(config))
    message = (
        "unsupported architecture MllamaForConditionalGeneration; supported: "
        "LlavaForConditionalGeneration, Qwen2VLForConditionalGeneration, "
        "Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration, "
        "Gemma3ForConditionalGeneration$"
    )
    with pytest.raises(ModelFormatError, match=message):
        family_of(model_dir)
    with pytest.raises(ModelFormatError, match=message):
        load_language(model_dir, torch.float32, "cpu")


def test_tiny_llava_resolves_to_llava(tiny_model_dir):
    assert family_of(tiny_model_dir) is LLAVA
    config = load_model_config(tiny_model_dir)
    assert isinstance(config, LlavaModelConfig)
    tokens = LLAVA.image_tokens(tiny_model_dir, config)
    assert tokens(640, 480) == tokens(28, 28) == 16  # fixed per image


def test_presets_belong_to_their_family():
    assert family_of_preset("tiny-llava") is LLAVA
    assert family_of_preset("tiny-qwen2-vl") is QWEN2_VL
    assert family_of_preset("tiny-qwen3-vl") is family_of_preset("qwen3-vl-8b") is QWEN3_VL
    assert family_of_preset("tiny-gemma3") is family_of_preset("gemma3-4b") is GEMMA3
    with pytest.raises(ValueError, match="unknown preset 'nope'; choose from tiny-llava"):
        family_of_preset("nope")


@pytest.mark.parametrize(
    ("height", "width", "expected"),
    [(28, 28, (56, 56)), (480, 640, (476, 644)), (4000, 3000, (1148, 840)), (100, 20, (112, 28))],
)
def test_smart_resize_matches_transformers(height, width, expected):
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as theirs

    ours = smart_resize(height, width, 28, 56 * 56, 28 * 28 * 1280)
    assert ours == theirs(height, width, 28, 56 * 56, 28 * 28 * 1280) == expected


def test_trace_image_tokens_use_the_processor_rule():
    """``epdctl trace``'s Qwen2-VL token counts are the engine's (min_pixels included)."""
    from epd_engine.workload.image_tokens import qwen2_vl

    assert qwen2_vl(28, 28) == 4  # raised to min_pixels = 56 x 56, as the processor does
    assert [qwen2_vl(280, 280), qwen2_vl(1280, 720), qwen2_vl(1920, 1080)] == [100, 1196, 2691]


def test_qwen3_vl_trace_tokens_are_the_released_processor_rule():
    """``epdctl trace``'s Qwen3-VL counts: the engine's rule under the release's bounds."""
    from epd_engine.model.qwen3_vl_config import Qwen3VLModelConfig
    from epd_engine.model.qwen3_vl_preset import QWEN3_VL_8B
    from epd_engine.model.registry import qwen2_vl_image_grid
    from epd_engine.workload.image_tokens import qwen3_vl

    config = Qwen3VLModelConfig.from_dict(QWEN3_VL_8B.hf_config("bfloat16"))
    bounds = {"min_pixels": QWEN3_VL_8B.min_pixels, "max_pixels": QWEN3_VL_8B.max_pixels}
    assert bounds == {"min_pixels": 256 * 256, "max_pixels": 4096 * 4096}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "preprocessor_config.json").write_text(
            json.dumps({**bounds, "patch_size": 16})
        )
        grid = qwen2_vl_image_grid(Path(tmp), config)
        for width, height in [(640, 640), (28, 28), (1920, 1080), (5000, 4000)]:
            _, h, w = grid(width, height)
            assert qwen3_vl(width, height) == h * w // 4
    assert [qwen3_vl(640, 640), qwen3_vl(28, 28)] == [400, 64]


def test_gemma3_trace_tokens_are_the_released_fixed_count():
    from epd_engine.model.gemma3_config import Gemma3ModelConfig
    from epd_engine.model.gemma3_preset import GEMMA3_4B
    from epd_engine.workload.image_tokens import get_image_tokenizer

    config = Gemma3ModelConfig.from_dict(GEMMA3_4B.hf_config("bfloat16"))
    gemma3 = get_image_tokenizer("gemma3")
    assert gemma3(640, 480) == gemma3(28, 28) == config.num_image_tokens == 256
    assert config.layer_windows.count(None) == 5 and config.sliding_window == 1024
