"""config.json parsing, including the hub's sparse llava-1.5-7b-hf config, and the presets."""

from __future__ import annotations

import pytest
import torch

from epd_engine.model.llava import LlavaLanguage, LlavaVision
from epd_engine.model.loader import required_tensors
from epd_engine.model.make_model import plan_shards, tensor_specs
from epd_engine.model.model_config import LlavaModelConfig, ModelFormatError
from epd_engine.model.presets import PRESETS

# llava-hf/llava-1.5-7b-hf config.json as published: most fields rely on transformers' defaults.
HUB_LLAVA_15_7B = {
    "architectures": ["LlavaForConditionalGeneration"],
    "ignore_index": -100,
    "image_token_index": 32000,
    "model_type": "llava",
    "pad_token_id": 32001,
    "projector_hidden_act": "gelu",
    "text_config": {
        "_name_or_path": "lmsys/vicuna-7b-v1.5",
        "architectures": ["LlamaForCausalLM"],
        "max_position_embeddings": 4096,
        "model_type": "llama",
        "rms_norm_eps": 1e-05,
        "torch_dtype": "float16",
        "vocab_size": 32064,
    },
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "vision_config": {
        "hidden_size": 1024,
        "image_size": 336,
        "intermediate_size": 4096,
        "model_type": "clip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "patch_size": 14,
        "projection_dim": 768,
        "vocab_size": 32000,
    },
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "vocab_size": 32064,
}


def test_hub_config_gets_transformers_defaults():
    config = LlavaModelConfig.from_dict(HUB_LLAVA_15_7B)
    assert config.num_image_tokens == 576
    assert (config.hidden_size, config.num_layers, config.num_heads) == (4096, 32, 32)
    assert (config.num_kv_heads, config.head_dim, config.intermediate_size) == (32, 128, 11008)
    assert config.rope_theta == 10000.0 and config.rms_norm_eps == 1e-5
    assert config.eos_token_id == 2 and config.image_token_index == 32000
    assert config.vision.hidden_act == "quick_gelu" and config.vision.num_layers_used == 23


def test_7b_preset_has_the_hub_shapes_and_parameter_count():
    preset = PRESETS["llava-1.5-7b"]
    assert LlavaModelConfig.from_dict(preset.hf_config("float16")) == LlavaModelConfig.from_dict(
        HUB_LLAVA_15_7B
    )
    specs = tensor_specs(preset)
    assert sum(spec.numel for spec in specs) == 7_063_427_072  # llava-1.5-7b-hf's count
    shards = plan_shards(specs, bytes_per_value=2, max_shard_bytes=5 * 1024**3)
    assert len(shards) == 3 and sum(len(shard) for shard in shards) == len(specs)


def test_generation_config_eos_wins():
    config = LlavaModelConfig.from_dict(HUB_LLAVA_15_7B, generation={"eos_token_id": [2, 7]})
    assert config.eos_token_ids == [2, 7]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "qwen2_vl"}, "expected 'llava'"),
        ({"vision_feature_layer": [-2, -5]}, "single integer vision_feature_layer"),
        ({"vision_feature_select_strategy": "cls"}, "unknown"),
        ({"text_config": {"rope_scaling": {"type": "linear", "factor": 2.0}}}, "rope_scaling"),
    ],
)
def test_unsupported_configs_are_rejected_clearly(change, message):
    with pytest.raises(ModelFormatError, match=message):
        LlavaModelConfig.from_dict({**HUB_LLAVA_15_7B, **change})


def test_7b_modules_take_exactly_the_hub_tensors():
    """Real shapes, no weights: every hub tensor feeds a parameter of matching shape, except
    the ones LLaVA never runs (last CLIP layer and post-LN at vision_feature_layer=-2)."""
    preset = PRESETS["llava-1.5-7b"]
    config = LlavaModelConfig.from_dict(preset.hf_config("float16"))
    shapes = {spec.name: spec.shape for spec in tensor_specs(preset)}
    with torch.device("meta"):
        parts = [LlavaVision(config), LlavaLanguage(config)]
    used: set[str] = set()
    for part in parts:
        params = dict(part.named_parameters())
        for param_name, sources in required_tensors(part).items():
            rows = sum(shapes[src][0] for src in sources)
            assert (rows, *shapes[sources[0]][1:]) == tuple(params[param_name].shape), param_name
            used.update(sources)
    unused = sorted(set(shapes) - used)
    assert all(".layers.23." in name or "post_layernorm" in name for name in unused)
    assert len(unused) == 16 + 2  # 16 tensors in a CLIP layer, post-LN weight and bias
