"""Write a random-weight checkpoint in a family's hub layout (LLaVA: the layout of
``llava-hf/llava-1.5-7b-hf``; Qwen2-VL: ``Qwen/Qwen2-VL-7B-Instruct``; Qwen3-VL:
``Qwen/Qwen3-VL-8B-Instruct``; Gemma 3: ``google/gemma-3-4b-it``).

Weights are generated shard by shard (only one shard in memory); values per tensor come
from ``make_specs.random_tensor``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from epd_engine.model.gemma3_files import write_gemma3_files
from epd_engine.model.gemma3_preset import GEMMA3_PRESETS, Gemma3Preset
from epd_engine.model.gemma3_preset import tensor_specs as gemma3_tensor_specs
from epd_engine.model.make_specs import (
    LOGIT_SCALE,
    TensorSpec,
    linear,
    norm,
    plan_shards,
    random_tensor,
)
from epd_engine.model.make_tokenizer import write_tokenizer_files
from epd_engine.model.presets import PRESETS, LlavaPreset
from epd_engine.model.qwen2_vl_files import write_qwen2_vl_files
from epd_engine.model.qwen2_vl_preset import QWEN2_VL_PRESETS, Qwen2VLPreset
from epd_engine.model.qwen2_vl_preset import tensor_specs as qwen2_vl_tensor_specs
from epd_engine.model.qwen3_vl_files import write_qwen3_vl_files
from epd_engine.model.qwen3_vl_preset import QWEN3_VL_PRESETS, Qwen3VLPreset
from epd_engine.model.qwen3_vl_preset import tensor_specs as qwen3_vl_tensor_specs

__all__ = ["ALL_PRESETS", "make_model", "plan_shards", "tensor_specs"]
ALL_PRESETS: dict[str, LlavaPreset | Qwen2VLPreset | Qwen3VLPreset | Gemma3Preset] = {
    **PRESETS,
    **QWEN2_VL_PRESETS,
    **QWEN3_VL_PRESETS,
    **GEMMA3_PRESETS,
}

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def tensor_specs(preset: LlavaPreset) -> list[TensorSpec]:
    """Every tensor of the hub checkpoint, in hub naming and a stable order."""
    vc, tc = preset.vision_config, preset.text_config
    hv, p, c = vc["hidden_size"], vc["patch_size"], vc.get("num_channels", 3)
    specs = [
        TensorSpec("vision_tower.vision_model.embeddings.class_embedding", (hv,), "normal"),
        TensorSpec(
            "vision_tower.vision_model.embeddings.patch_embedding.weight",
            (hv, c, p, p),
            "normal",
            1 / (c * p * p) ** 0.5,
        ),
        TensorSpec(
            "vision_tower.vision_model.embeddings.position_embedding.weight",
            (preset.num_image_tokens + 1, hv),
            "normal",
        ),
        *norm("vision_tower.vision_model.pre_layrnorm", hv, bias=True),
    ]
    for i in range(vc["num_hidden_layers"]):
        base = f"vision_tower.vision_model.encoder.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            specs += linear(f"{base}.self_attn.{proj}", hv, hv, bias=True)
        specs += norm(f"{base}.layer_norm1", hv, bias=True)
        specs += linear(f"{base}.mlp.fc1", vc["intermediate_size"], hv, bias=True)
        specs += linear(f"{base}.mlp.fc2", hv, vc["intermediate_size"], bias=True)
        specs += norm(f"{base}.layer_norm2", hv, bias=True)
    specs += norm("vision_tower.vision_model.post_layernorm", hv, bias=True)
    h, inter = tc["hidden_size"], tc["intermediate_size"]
    specs += linear("multi_modal_projector.linear_1", h, hv, bias=True)
    specs += linear("multi_modal_projector.linear_2", h, h, bias=True)

    head_dim = h // tc["num_attention_heads"]
    q_size, kv_size = h, tc["num_key_value_heads"] * head_dim
    specs.append(
        TensorSpec("language_model.model.embed_tokens.weight", (tc["vocab_size"], h), "normal")
    )
    for i in range(tc["num_hidden_layers"]):
        base = f"language_model.model.layers.{i}"
        specs += linear(f"{base}.self_attn.q_proj", q_size, h, bias=False)
        specs += linear(f"{base}.self_attn.k_proj", kv_size, h, bias=False)
        specs += linear(f"{base}.self_attn.v_proj", kv_size, h, bias=False)
        specs += linear(f"{base}.self_attn.o_proj", h, q_size, bias=False)
        specs += linear(f"{base}.mlp.gate_proj", inter, h, bias=False)
        specs += linear(f"{base}.mlp.up_proj", inter, h, bias=False)
        specs += linear(f"{base}.mlp.down_proj", h, inter, bias=False)
        specs += norm(f"{base}.input_layernorm", h, bias=False)
        specs += norm(f"{base}.post_attention_layernorm", h, bias=False)
    specs += norm("language_model.model.norm", h, bias=False)
    specs += linear("language_model.lm_head", tc["vocab_size"], h, bias=False, gain=LOGIT_SCALE)
    return specs


def make_model(
    preset: str,
    out_dir: Path,
    seed: int = 0,
    dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    show_progress: bool = True,
) -> Path:
    """Write config, weights, tokenizer and processor files of ``preset`` into ``out_dir``."""
    if preset not in ALL_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(ALL_PRESETS)}")
    spec_preset = ALL_PRESETS[preset]
    dtype_name = dtype or spec_preset.default_dtype
    torch_dtype = getattr(torch, dtype_name, None)
    if dtype_name not in ("float32", "float16", "bfloat16") or torch_dtype is None:
        raise ValueError(f"unsupported dtype {dtype_name!r}: use float32, float16 or bfloat16")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(
        json.dumps(spec_preset.hf_config(dtype_name), indent=2) + "\n"
    )
    if isinstance(spec_preset, Gemma3Preset):
        write_gemma3_files(spec_preset, out_dir)
        specs = gemma3_tensor_specs(spec_preset)
    elif isinstance(spec_preset, Qwen3VLPreset):
        write_qwen3_vl_files(spec_preset, out_dir)
        specs = qwen3_vl_tensor_specs(spec_preset)
    elif isinstance(spec_preset, Qwen2VLPreset):
        write_qwen2_vl_files(spec_preset, out_dir)
        specs = qwen2_vl_tensor_specs(spec_preset)
    else:
        write_tokenizer_files(spec_preset, out_dir)
        specs = tensor_specs(spec_preset)
    _write_weights(specs, out_dir, seed, torch_dtype, max_shard_bytes, show_progress)
    return out_dir


def _write_weights(
    specs: list[TensorSpec],
    out_dir: Path,
    seed: int,
    dtype: torch.dtype,
    max_shard_bytes: int,
    show_progress: bool,
) -> None:
    bytes_per_value = torch.empty((), dtype=dtype).element_size()
    shards = plan_shards(specs, bytes_per_value, max_shard_bytes)
    total_bytes = sum(spec.numel for spec in specs) * bytes_per_value
    weight_map: dict[str, str] = {}
    progress = tqdm(
        total=total_bytes, unit="B", unit_scale=True, disable=not show_progress, desc="weights"
    )
    # Sampling is the slow part and torch releases the GIL: one thread per tensor.
    workers = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1))
    with progress as bar, workers as pool:
        for file_name, shard in _named_shards(shards):
            tensors = {}
            values = pool.map(lambda spec: random_tensor(spec, seed, dtype), shard)
            for spec, tensor in zip(shard, values, strict=True):
                tensors[spec.name] = tensor
                weight_map[spec.name] = file_name
                bar.update(spec.numel * bytes_per_value)
            save_file(tensors, str(out_dir / file_name), metadata={"format": "pt"})
            del tensors  # only one shard in memory
    if len(shards) > 1:
        index_data = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index_data, indent=2))


def _named_shards(shards: list[list[TensorSpec]]) -> Iterator[tuple[str, list[TensorSpec]]]:
    if len(shards) == 1:
        yield "model.safetensors", shards[0]
        return
    for i, shard in enumerate(shards):
        yield f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors", shard
