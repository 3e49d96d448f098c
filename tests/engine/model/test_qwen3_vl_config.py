"""Qwen3-VL's config as the hub publishes it, the 8B tensor layout, and the image-cache row
that carries the DeepStack levels."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from epd_engine.model.loader import required_tensors
from epd_engine.model.model_config import ModelFormatError
from epd_engine.model.qwen3_vl import Qwen3VLLanguage, Qwen3VLVision
from epd_engine.model.qwen3_vl_config import Qwen3VLModelConfig
from epd_engine.model.qwen3_vl_preset import QWEN3_VL_8B, tensor_specs
from epd_engine.model.registry import QWEN3_VL, family_for

# Qwen/Qwen3-VL-8B-Instruct config.json as published (text and vision nested).
HUB_QWEN3_VL_8B: dict[str, Any] = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "image_token_id": 151655,
    "model_type": "qwen3_vl",
    "text_config": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "dtype": "bfloat16",
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 12288,
        "max_position_embeddings": 262144,
        "model_type": "qwen3_vl_text",
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "mrope_interleaved": True,
            "mrope_section": [24, 20, 20],
            "rope_type": "default",
        },
        "rope_theta": 5000000,
        "use_cache": True,
        "vocab_size": 151936,
    },
    "tie_word_embeddings": False,
    "video_token_id": 151656,
    "vision_config": {
        "deepstack_visual_indexes": [8, 16, 24],
        "depth": 27,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 4304,
        "model_type": "qwen3_vl",
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": 4096,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    "vision_end_token_id": 151653,
    "vision_start_token_id": 151652,
}


def test_hub_8b_config_parses_and_matches_our_preset_tensor_by_tensor():
    config = Qwen3VLModelConfig.from_dict(HUB_QWEN3_VL_8B)
    assert family_for(HUB_QWEN3_VL_8B) is QWEN3_VL
    assert (config.head_dim, config.mrope_section, config.image_token_index) == (
        128,
        (24, 20, 20),
        151655,
    )
    assert config.vision.deepstack_indexes == (8, 16, 24)
    assert config.vision.position_grid_side == 48
    # an image token's row: the embedding and three DeepStack levels, 32 KiB in bfloat16
    assert config.image_row_size == 4 * 4096
    ours = Qwen3VLModelConfig.from_dict(QWEN3_VL_8B.hf_config("bfloat16"))
    assert ours == config
    with torch.device("meta"):  # shapes only, nothing allocated
        parts = [Qwen3VLVision(config), Qwen3VLLanguage(config)]
    shapes = {spec.name: spec.shape for spec in tensor_specs(QWEN3_VL_8B)}
    used: set[str] = set()
    for part in parts:
        params = dict(part.named_parameters())
        for name, sources in required_tensors(part).items():
            rows = sum(shapes[src][0] for src in sources)
            assert (rows, *shapes[sources[0]][1:]) == tuple(params[name].shape), name
            used.update(sources)
    assert used == set(shapes)  # every hub tensor is loaded, none is missing
    billions = sum(p.numel() for part in parts for p in part.parameters()) / 1e9
    assert 8.7 < billions < 8.8  # Qwen3-VL-8B-Instruct has 8.77 B parameters


def test_tied_embeddings_read_the_embedding_table():
    raw = {**HUB_QWEN3_VL_8B, "tie_word_embeddings": True}
    config = Qwen3VLModelConfig.from_dict(raw)
    source = QWEN3_VL.layout.language_source(config, "lm_head.weight")
    assert source == "model.language_model.embed_tokens.weight"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rope_scaling": {"mrope_section": [24, 20]}}, "summing to head_dim / 2 = 64"),
        ({"rope_scaling": {"mrope_section": [24, 20, 20], "mrope_interleaved": False}},
         "only interleaved M-RoPE"),
        ({"attention_bias": True}, "attention_bias is not supported"),
    ],
)  # fmt: skip
def test_unsupported_text_configs_are_clear_errors(change, message):
    raw = {**HUB_QWEN3_VL_8B, "text_config": {**HUB_QWEN3_VL_8B["text_config"], **change}}
    with pytest.raises(ModelFormatError, match=message):
        Qwen3VLModelConfig.from_dict(raw)


def test_deepstack_indexes_must_be_blocks():
    vision = {**HUB_QWEN3_VL_8B["vision_config"], "deepstack_visual_indexes": [8, 27]}
    with pytest.raises(ModelFormatError, match=r"must be blocks 0..26"):
        Qwen3VLModelConfig.from_dict({**HUB_QWEN3_VL_8B, "vision_config": vision})
