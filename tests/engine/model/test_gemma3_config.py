"""Gemma 3's config parser and processor rules on the release's config form."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from epd_engine.model.gemma3_config import Gemma3ModelConfig
from epd_engine.model.gemma3_preset import GEMMA3_4B
from epd_engine.model.gemma3_processor import load_gemma3_processor
from epd_engine.model.model_config import ModelFormatError


def release_config() -> dict:
    """gemma-3-4b-it's form: ``sliding_window_pattern``, no ``layer_types``."""
    raw = GEMMA3_4B.hf_config("bfloat16")
    del raw["text_config"]["layer_types"]
    raw["text_config"]["sliding_window_pattern"] = 6
    return raw


def test_every_sixth_layer_is_global_without_layer_types():
    config = Gemma3ModelConfig.from_dict(release_config())
    globals_ = [i for i, w in enumerate(config.layer_windows) if w is None]
    assert globals_ == [5, 11, 17, 23, 29]
    assert config.sliding_window == 1024 and config.num_layers == 34
    assert config.rope_scaling_factor == 8.0 and config.rope_local_theta == 10_000.0
    assert config.query_pre_attn_scalar == 256 and config.tie_word_embeddings
    assert config.image_token_index == 262144 and config.num_image_tokens == 256


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, "rope_scaling type 'yarn'"),
        ({"layer_types": ["sliding_attention"]}, "for each of the 34 layers"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping is not supported"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ],
)
def test_what_the_model_does_not_run_is_refused(change, message):
    raw = release_config()
    raw["text_config"].update(change)
    with pytest.raises(ModelFormatError, match=message):
        Gemma3ModelConfig.from_dict(raw)


def test_a_token_grid_that_does_not_pool_the_patches_is_refused():
    raw = release_config()
    raw["mm_tokens_per_image"] = 200
    with pytest.raises(ModelFormatError, match="mm_tokens_per_image 200"):
        Gemma3ModelConfig.from_dict(raw)


def test_pan_and_scan_is_refused(tiny_gemma3_dir: Path, tmp_path: Path):
    """Crops would add images the fixed per-image token rule does not count."""
    processor = load_gemma3_processor(tiny_gemma3_dir)
    with pytest.raises(ValueError, match="pan-and-scan"):
        processor(text="<start_of_image>", images=None, do_pan_and_scan=True)
    model_dir = shutil.copytree(tiny_gemma3_dir, tmp_path / "crops")
    path = model_dir / "preprocessor_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "do_pan_and_scan": True}))
    with pytest.raises(ModelFormatError, match="do_pan_and_scan is set"):
        load_gemma3_processor(model_dir)
