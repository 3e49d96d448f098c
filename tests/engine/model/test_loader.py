"""Part loaders: each reads only its own tensors, accepts both key layouts, fails clearly."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import epd_engine.model.loader as loader_module
from epd_engine.model.loader import load_language, load_vision
from epd_engine.model.make_model import make_model
from epd_engine.model.model_config import ModelFormatError

VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")


class RecordingSafeOpen:
    """Wraps ``safe_open`` and records every tensor actually read."""

    def __init__(self) -> None:
        self.read: list[str] = []

    def __call__(self, path: str, framework: str, device: str = "cpu"):
        recorder = self
        inner = safe_open(path, framework=framework, device=device)

        class Handle:
            def __enter__(self):
                self.handle = inner.__enter__()
                return self

            def __exit__(self, *exc):
                return inner.__exit__(*exc)

            def keys(self):
                return self.handle.keys()

            def get_tensor(self, name: str):
                recorder.read.append(name)
                return self.handle.get_tensor(name)

        return Handle()


def rewrite_checkpoint(
    src: Path, dst: Path, transform: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
) -> Path:
    """Copy a single-file checkpoint with its tensors passed through ``transform``."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = transform(load_file(src / "model.safetensors"))
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_load_vision_reads_and_allocates_only_the_vision_part(tiny_model_dir, monkeypatch):
    spy = RecordingSafeOpen()
    monkeypatch.setattr(loader_module, "safe_open", spy)
    vision = load_vision(tiny_model_dir, torch.float32, "cpu")
    assert spy.read and all(name.startswith(VISION_PREFIXES) for name in spy.read)
    # Only the layers up to vision_feature_layer=-2 (2 of 3) are read; never the post-LN.
    assert not any(".layers.2." in name or "post_layernorm" in name for name in spy.read)
    assert len(vision.vision_model.layers) == 2
    assert not any(
        "embed_tokens" in name or "lm_head" in name for name, _ in vision.named_parameters()
    )


def test_load_language_reads_and_allocates_only_the_language_part(tiny_model_dir, monkeypatch):
    spy = RecordingSafeOpen()
    monkeypatch.setattr(loader_module, "safe_open", spy)
    language = load_language(tiny_model_dir, torch.float32, "cpu")
    assert spy.read and all(name.startswith("language_model.") for name in spy.read)
    assert not any(name.startswith("vision") for name, _ in language.named_parameters())


def test_fused_weights_hold_the_checkpoint_tensors(tiny_model_dir, language):
    stored = load_file(tiny_model_dir / "model.safetensors")
    base = "language_model.model.layers.1"
    expected_qkv = torch.cat([stored[f"{base}.self_attn.{p}_proj.weight"] for p in "qkv"])
    torch.testing.assert_close(
        language.layers[1].self_attn.qkv_proj.weight, expected_qkv, rtol=0, atol=0
    )
    expected_gate_up = torch.cat([stored[f"{base}.mlp.{p}_proj.weight"] for p in ("gate", "up")])
    torch.testing.assert_close(
        language.layers[1].mlp.gate_up_proj.weight, expected_gate_up, rtol=0, atol=0
    )
    torch.testing.assert_close(
        language.lm_head.weight, stored["language_model.lm_head.weight"], rtol=0, atol=0
    )


def test_loads_the_newer_transformers_key_layout(tiny_model_dir, tmp_path, vision, language):
    def to_new_layout(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        renamed = {}
        for name, tensor in tensors.items():
            for old, new in (
                ("language_model.model.", "model.language_model."),
                ("language_model.lm_head.", "lm_head."),
                ("vision_tower.", "model.vision_tower."),
                ("multi_modal_projector.", "model.multi_modal_projector."),
            ):
                if name.startswith(old):
                    renamed[new + name.removeprefix(old)] = tensor
        return renamed

    new_dir = rewrite_checkpoint(tiny_model_dir, tmp_path / "new", to_new_layout)
    assert "lm_head.weight" in load_file(new_dir / "model.safetensors")
    new_vision = load_vision(new_dir, torch.float32, "cpu")
    new_language = load_language(new_dir, torch.float32, "cpu")
    for ours, theirs in ((new_vision, vision), (new_language, language)):
        for (name, a), (_, b) in zip(
            ours.named_parameters(), theirs.named_parameters(), strict=True
        ):
            assert torch.equal(a, b), name


def test_loads_a_sharded_checkpoint_with_index(tiny_model_dir, tmp_path, language):
    sharded = make_model(
        "tiny-llava",
        tmp_path / "sharded",
        seed=0,
        dtype="float32",
        max_shard_bytes=200_000,
        show_progress=False,
    )
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    assert not (sharded / "model.safetensors").exists()
    sharded_language = load_language(sharded, torch.float16, "cpu")
    assert sharded_language.lm_head.weight.dtype == torch.float16
    torch.testing.assert_close(sharded_language.lm_head.weight, language.lm_head.weight.half())
    load_vision(sharded, torch.float32, "cpu")


def test_missing_config_is_a_clear_error(tmp_path):
    with pytest.raises(ModelFormatError, match=re.escape("config.json not found")):
        load_language(tmp_path, torch.float32, "cpu")


def test_non_llava_config_is_a_clear_error(tiny_model_dir, tmp_path):
    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "llama")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(ModelFormatError, match="model_type is 'llama', expected 'llava'"):
        load_vision(model_dir, torch.float32, "cpu")


def test_missing_tensor_is_named(tiny_model_dir, tmp_path):
    gone = "language_model.model.layers.1.self_attn.k_proj.weight"
    model_dir = rewrite_checkpoint(
        tiny_model_dir, tmp_path / "missing", lambda t: {k: v for k, v in t.items() if k != gone}
    )
    with pytest.raises(ModelFormatError, match=re.escape(f"missing tensors: {gone}")):
        load_language(model_dir, torch.float32, "cpu")
    load_vision(model_dir, torch.float32, "cpu")  # the vision part is complete


def test_unexpected_tensor_is_named(tiny_model_dir, tmp_path):
    extra = "language_model.model.layers.0.self_attn.q_norm.weight"
    model_dir = rewrite_checkpoint(
        tiny_model_dir, tmp_path / "extra", lambda t: {**t, extra: torch.ones(16)}
    )
    with pytest.raises(ModelFormatError, match=re.escape(f"unexpected tensors: {extra}")):
        load_language(model_dir, torch.float32, "cpu")


def test_wrong_shape_is_named(tiny_model_dir, tmp_path):
    name = "multi_modal_projector.linear_2.weight"
    model_dir = rewrite_checkpoint(
        tiny_model_dir, tmp_path / "shape", lambda t: {**t, name: torch.zeros(64, 32)}
    )
    with pytest.raises(ModelFormatError, match=re.escape(f"tensor {name} has shape")):
        load_vision(model_dir, torch.float32, "cpu")


def test_loads_what_transformers_save_pretrained_writes(hf_model, tmp_path, language, vision):
    hf_model.save_pretrained(tmp_path / "saved")
    saved_language = load_language(tmp_path / "saved", torch.float32, "cpu")
    saved_vision = load_vision(tmp_path / "saved", torch.float32, "cpu")
    assert saved_language.config == language.config
    for ours, reference in ((saved_language, language), (saved_vision, vision)):
        for (name, a), (_, b) in zip(
            ours.named_parameters(), reference.named_parameters(), strict=True
        ):
            assert torch.equal(a, b), name
