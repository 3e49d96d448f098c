"""Qwen2-VL part loaders: each reads only its own tensors; both key layouts load."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

import epd_engine.model.loader as loader_module
from epd_engine.model.loader import load_language, load_vision
from tests.engine.model.test_loader import RecordingSafeOpen, rewrite_checkpoint


def test_vision_and_language_read_only_their_tensors(tiny_qwen2_vl_dir: Path, monkeypatch):
    spy = RecordingSafeOpen()
    monkeypatch.setattr(loader_module, "safe_open", spy)
    load_vision(tiny_qwen2_vl_dir, torch.float32, "cpu")
    assert spy.read and all(name.startswith("visual.") for name in spy.read)
    spy.read.clear()
    load_language(tiny_qwen2_vl_dir, torch.float32, "cpu")
    assert spy.read and not any(name.startswith("visual.") for name in spy.read)


def test_loads_the_newer_transformers_key_layout(tiny_qwen2_vl_dir: Path, tmp_path: Path):
    """``model.visual.*`` / ``model.language_model.*`` / ``lm_head.*``, as transformers >= 4.52
    names the modules (and as some converted checkpoints store them)."""

    def renamed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, value in tensors.items():
            if name.startswith("visual."):
                name = "model." + name
            elif name.startswith("model."):
                name = "model.language_model." + name.removeprefix("model.")
            out[name] = value
        return out

    model_dir = rewrite_checkpoint(tiny_qwen2_vl_dir, tmp_path / "new", renamed)
    assert "model.language_model.norm.weight" in load_file(model_dir / "model.safetensors")
    for load in (load_vision, load_language):
        ours = load(model_dir, torch.float32, "cpu")
        reference = load(tiny_qwen2_vl_dir, torch.float32, "cpu")
        for (name, a), (_, b) in zip(
            ours.state_dict().items(), reference.state_dict().items(), strict=True
        ):
            assert torch.equal(a, b), name
