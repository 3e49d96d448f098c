"""Load one part of a LLaVA checkpoint (hub safetensors layout) without touching the other.

An E instance calls ``load_vision`` and never reads or allocates the LLM; P/D instances
call ``load_language`` and never read the vision tower. Modules are built on the meta
device, materialised empty, then filled tensor by tensor through ``safe_open``.

Both key layouts are accepted: the hub's (``language_model.model.*``, ``vision_tower.*``,
``multi_modal_projector.*``, ``language_model.lm_head.*``) and the one newer transformers
saves (``model.language_model.*``, ``model.vision_tower.*``, ``lm_head.*`` ...).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from safetensors import safe_open
from torch import nn

from epd_engine.model.attention import AttentionBackend
from epd_engine.model.llava import LlavaLanguage, LlavaVision
from epd_engine.model.model_config import LlavaModelConfig, ModelFormatError

# Newer transformers layout -> hub layout (the canonical names below).
_NEW_TO_HUB = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
)
_M = TypeVar("_M", bound=nn.Module)
_LANGUAGE_PREFIX = "language_model."
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")
# Our fused parameters read several hub tensors, concatenated along dim 0 in this order.
_FUSED = (
    (".qkv_proj.", (".q_proj.", ".k_proj.", ".v_proj.")),
    (".gate_up_proj.", (".gate_proj.", ".up_proj.")),
)


def load_vision(model_dir: Path, dtype: torch.dtype, device: str) -> LlavaVision:
    """The CLIP tower + projector; reads only ``vision_tower.*`` / ``multi_modal_projector.*``."""
    config = LlavaModelConfig.from_dir(Path(model_dir))
    with torch.device("meta"):  # no storage until _materialise
        model = LlavaVision(config)
    model = _materialise(model, dtype, device)
    used_layers = config.vision.num_layers_used
    unused = re.compile(
        r"vision_tower\.vision_model\.(post_layernorm\..*|embeddings\.position_ids"
        r"|encoder\.layers\.(\d+)\..*)$"
    )

    def is_skippable(name: str) -> bool:
        # LLaVA never runs the layers after vision_feature_layer, nor the post-LN.
        match = unused.match(name)
        if match is None:
            return False
        return match.group(2) is None or int(match.group(2)) >= used_layers

    _fill(model, Path(model_dir), _VISION_PREFIXES, is_skippable)
    return model.eval()


def load_language(
    model_dir: Path,
    dtype: torch.dtype,
    device: str,
    attention: AttentionBackend | None = None,
) -> LlavaLanguage:
    """The LLaMA decoder + LM head; reads only ``language_model.*`` tensors."""
    config = LlavaModelConfig.from_dir(Path(model_dir))
    with torch.device("meta"):
        language = LlavaLanguage(config, attention)
    language = _materialise(language, dtype, device)

    def is_skippable(name: str) -> bool:
        return name.endswith("rotary_emb.inv_freq")  # old checkpoints saved this buffer

    _fill(language, Path(model_dir), (_LANGUAGE_PREFIX,), is_skippable)
    return language.eval()


def _materialise(model: _M, dtype: torch.dtype, device: str) -> _M:
    """Meta-device module -> uninitialised storage of ``dtype`` on ``device`` (filled next)."""
    return model.to(dtype=dtype).to_empty(device=device)


def _vision_source(param_name: str) -> str:
    if param_name.startswith("vision_model."):
        return "vision_tower.vision_model." + param_name.removeprefix("vision_model.").replace(
            "layers.", "encoder.layers.", 1
        )
    return param_name  # multi_modal_projector.*


def _language_source(param_name: str) -> str:
    if param_name.startswith("lm_head."):
        return "language_model." + param_name
    return "language_model.model." + param_name


def required_tensors(model: LlavaVision | LlavaLanguage) -> dict[str, list[str]]:
    """Our parameter name -> the hub tensor names it is made of (several for fused ones)."""
    to_canonical = _vision_source if isinstance(model, LlavaVision) else _language_source
    return {name: _sources(to_canonical(name)) for name, _ in model.named_parameters()}


def _sources(canonical: str) -> list[str]:
    for fused, parts in _FUSED:
        if fused in canonical:
            return [canonical.replace(fused, part) for part in parts]
    return [canonical]


def _fill(
    model: LlavaVision | LlavaLanguage,
    model_dir: Path,
    own_prefixes: tuple[str, ...],
    is_skippable: Callable[[str], bool],
) -> None:
    """Copy every parameter from the checkpoint; error on missing or unexpected tensors."""
    locations = checkpoint_locations(model_dir)  # canonical name -> (file, stored name)
    wanted = required_tensors(model)
    needed = {src for srcs in wanted.values() for src in srcs}
    missing = sorted(src for src in needed if src not in locations)
    if missing:
        raise ModelFormatError(f"{model_dir}: missing tensors: {_listing(missing)}")
    all_prefixes = (_LANGUAGE_PREFIX, *_VISION_PREFIXES)
    unexpected = sorted(
        name
        for name in locations
        if name not in needed
        and not is_skippable(name)
        and (name.startswith(own_prefixes) or not name.startswith(all_prefixes))
    )
    if unexpected:
        raise ModelFormatError(f"{model_dir}: unexpected tensors: {_listing(unexpected)}")

    by_file: dict[Path, list[str]] = defaultdict(list)
    for src in needed:
        by_file[locations[src][0]].append(src)
    owner = {src: name for name, srcs in wanted.items() for src in srcs}
    params = dict(model.named_parameters())
    loaded: dict[str, torch.Tensor] = {}
    for file, names in sorted(by_file.items()):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for src in sorted(names):
                loaded[src] = handle.get_tensor(locations[src][1])
                # Copy once all parts of a parameter are read: host copies do not pile up.
                param_name = owner[src]
                srcs = wanted[param_name]
                if all(part in loaded for part in srcs):
                    _copy(params[param_name], [loaded.pop(part) for part in srcs], param_name, srcs)


def _copy(param: nn.Parameter, parts: list[torch.Tensor], name: str, srcs: list[str]) -> None:
    value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    if value.shape != param.shape:
        raise ModelFormatError(
            f"tensor {', '.join(srcs)} has shape {tuple(value.shape)}, "
            f"expected {tuple(param.shape)} for {name}"
        )
    with torch.no_grad():
        param.copy_(value)


def checkpoint_locations(model_dir: Path) -> dict[str, tuple[Path, str]]:
    """Every tensor in the checkpoint: hub-layout name -> (file, name as stored)."""
    index_path = model_dir / "model.safetensors.index.json"
    stored: dict[str, Path] = {}
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text()).get("weight_map", {})
        stored = {name: model_dir / file for name, file in weight_map.items()}
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ModelFormatError(f"{model_dir}: no *.safetensors weights found")
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                stored.update(dict.fromkeys(handle.keys(), file))
    locations: dict[str, tuple[Path, str]] = {}
    for name, file in stored.items():
        canonical = name
        for new, hub in _NEW_TO_HUB:
            if name.startswith(new):
                canonical = hub + name.removeprefix(new)
                break
        locations[canonical] = (file, name)
    return locations


def _listing(names: list[str], limit: int = 8) -> str:
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
