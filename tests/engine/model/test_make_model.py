"""``epdctl make-model``: files that transformers and our loaders both accept."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from epd_engine.cli import main
from epd_engine.model.model_config import LlavaModelConfig


def test_cli_writes_a_checkpoint_and_refuses_to_overwrite(tmp_path, capsys):
    out_dir = tmp_path / "m"
    assert main(["make-model", str(out_dir), "--preset", "tiny-llava", "--seed", "3"]) == 0
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.json",
        "preprocessor_config.json",
        "processor_config.json",
        "generation_config.json",
    ):
        assert (out_dir / name).is_file(), name
    assert main(["make-model", str(out_dir)]) == 2
    assert "already holds a model" in capsys.readouterr().err


def test_seed_decides_the_weights(tiny_model_dir, tmp_path):
    assert main(["make-model", str(tmp_path / "s0"), "--dtype", "float32"]) == 0
    assert main(["make-model", str(tmp_path / "s1"), "--seed", "1", "--dtype", "float32"]) == 0
    reference = load_file(tiny_model_dir / "model.safetensors")
    same_seed = load_file(tmp_path / "s0" / "model.safetensors")
    other_seed = load_file(tmp_path / "s1" / "model.safetensors")
    name = "language_model.model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(reference[name], same_seed[name])
    assert not torch.equal(reference[name], other_seed[name])


def test_transformers_loads_it_without_missing_or_unexpected_keys(tiny_model_dir):
    from transformers import LlavaForConditionalGeneration

    _, info = LlavaForConditionalGeneration.from_pretrained(
        tiny_model_dir, dtype=torch.float32, output_loading_info=True
    )
    assert info["missing_keys"] == [] and info["unexpected_keys"] == []
    assert info["mismatched_keys"] == []


def test_tokenizer_and_processor_agree_with_the_config(tiny_model_dir, processor):
    config = LlavaModelConfig.from_dir(tiny_model_dir)
    tokenizer = processor.tokenizer
    assert tokenizer.convert_tokens_to_ids("<image>") == config.image_token_index == 1000
    assert tokenizer.eos_token_id == config.eos_token_id == 2
    assert tokenizer.bos_token_id == 1 and tokenizer.pad_token_id == 1001
    assert len(tokenizer) == config.vocab_size == 1002
    text = "The quick brown fox jumps over the lazy dog. 3.14 {ok}"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == 1 and tokenizer.decode(ids, skip_special_tokens=True) == text
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi?"}]}],
        add_generation_prompt=True,
    )
    assert prompt == "USER: <image>\nHi? ASSISTANT:"
    assert json.loads((tiny_model_dir / "config.json").read_text())["image_seq_length"] == 16


def test_cli_presets_are_the_presets_make_model_knows():
    from epd_engine.commands.make_model import PRESET_NAMES
    from epd_engine.model.make_model import ALL_PRESETS
    from epd_engine.model.registry import FAMILIES

    assert set(PRESET_NAMES) == set(ALL_PRESETS)
    assert set(PRESET_NAMES) == {preset for family in FAMILIES for preset in family.presets}


def test_cli_writes_a_qwen2_vl_checkpoint(tmp_path):
    out_dir = tmp_path / "q"
    assert main(["make-model", str(out_dir), "--preset", "tiny-qwen2-vl"]) == 0
    config = json.loads((out_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2VLForConditionalGeneration"]
    weights = load_file(out_dir / "model.safetensors")
    assert "visual.merger.mlp.2.weight" in weights and "lm_head.weight" in weights
    assert "model.layers.1.self_attn.k_proj.bias" in weights
