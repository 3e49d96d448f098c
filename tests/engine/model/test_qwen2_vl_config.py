"""Qwen2-VL / Qwen2.5-VL configs as the hub publishes them, and the 7B tensor layouts."""

from __future__ import annotations

import pytest
import torch

from epd_engine.model.loader import required_tensors
from epd_engine.model.model_config import ModelFormatError
from epd_engine.model.qwen2_vl import Qwen2VLLanguage, Qwen2VLVision
from epd_engine.model.qwen2_vl_config import Qwen2VLModelConfig
from epd_engine.model.qwen2_vl_preset import QWEN2_5_VL_7B, QWEN2_VL_7B, tensor_specs
from epd_engine.model.registry import family_for

# Qwen/Qwen2-VL-7B-Instruct config.json as published (text fields at the top level).
HUB_QWEN2_VL_7B = {
    "architectures": ["Qwen2VLForConditionalGeneration"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "model_type": "qwen2_vl",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {
        "depth": 32,
        "embed_dim": 1280,
        "mlp_ratio": 4,
        "num_heads": 16,
        "in_chans": 3,
        "hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "temporal_patch_size": 2,
    },
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 152064,
}
HUB_QWEN2_5_VL_7B = {
    **{k: v for k, v in HUB_QWEN2_VL_7B.items() if k != "vision_config"},
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "vision_config": {
        "depth": 32,
        "hidden_act": "silu",
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "in_chans": 3,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
        "temporal_patch_size": 2,
    },
}


@pytest.mark.parametrize(
    ("raw", "preset"), [(HUB_QWEN2_VL_7B, QWEN2_VL_7B), (HUB_QWEN2_5_VL_7B, QWEN2_5_VL_7B)]
)
def test_hub_7b_configs_parse_and_match_our_presets_tensor_by_tensor(raw, preset):
    config = Qwen2VLModelConfig.from_dict(raw)
    assert family_for(raw).model_type == raw["model_type"]
    assert (config.head_dim, config.mrope_section, config.image_token_index) == (
        128,
        (16, 24, 24),
        151655,
    )
    assert config.vision.windowed == (raw["model_type"] == "qwen2_5_vl")
    assert Qwen2VLModelConfig.from_dict(preset.hf_config("bfloat16")) == config
    with torch.device("meta"):  # shapes only, nothing allocated
        parts = [Qwen2VLVision(config), Qwen2VLLanguage(config)]
    shapes = {spec.name: spec.shape for spec in tensor_specs(preset)}
    used: set[str] = set()
    for part in parts:
        params = dict(part.named_parameters())
        for name, sources in required_tensors(part).items():
            rows = sum(shapes[src][0] for src in sources)
            assert (rows, *shapes[sources[0]][1:]) == tuple(params[name].shape), name
            used.update(sources)
    assert used == set(shapes)  # every hub tensor is loaded, none is missing
    billions = sum(p.numel() for part in parts for p in part.parameters()) / 1e9
    assert 8.2 < billions < 8.4  # the 7B "Instruct" models have 8.29 B parameters


def test_bad_mrope_section_is_a_clear_error():
    raw = {**HUB_QWEN2_VL_7B, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24]}}
    message = r"mrope_section must be three ints summing to head_dim / 2 = 64, got \[16, 24\]"
    with pytest.raises(ModelFormatError, match=message):
        Qwen2VLModelConfig.from_dict(raw)
