"""Load one part of a checkpoint (hub safetensors layout) without touching the other.

An E instance calls ``load_vision`` and never reads or allocates the LLM; P/D instances
call ``load_language`` and never read the vision tower. The checkpoint's family
(``registry.family_of``) gives the module classes and where their tensors live. Modules
are built on the meta device, materialised empty, then filled tensor by tensor through
``safe_open``.

Both key layouts are accepted: the hub's (LLaVA: ``language_model.model.*``,
``vision_tower.*`` ...; Qwen2-VL: ``model.*``, ``visual.*``) and the one newer
transformers saves (``model.language_model.*``, ``model.visual.*``, ``lm_head.*`` ...).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import safe_open
from torch import nn

from epd_engine.model.attention import AttentionBackend
from epd_engine.model.model_config import ModelFormatError
from epd_engine.model.registry import CheckpointLayout, ModelFamily, family_of
from epd_engine.parallel.layers import TensorParallel, parallelize
from epd_engine.parallel.sharding import Shard, shard_config

_M = TypeVar("_M", bound=nn.Module)
# Our fused parameters read several hub tensors, concatenated along dim 0 in this order.
_FUSED = (
    (".qkv_proj.", (".q_proj.", ".k_proj.", ".v_proj.")),
    (".gate_up_proj.", (".gate_proj.", ".up_proj.")),
)


def load_vision(model_dir: Path, dtype: torch.dtype, device: str) -> Any:
    """The family's vision part (E stage); reads only its vision tensors."""
    family = family_of(Path(model_dir))
    config = family.load_config(Path(model_dir))
    vision_class, _ = family.classes()
    with torch.device("meta"):  # no storage until _materialise
        model = vision_class(config)
    model = _materialise(model, dtype, device)
    layout = family.layout
    _fill(model, Path(model_dir), family, layout.vision_prefixes, layout.vision_skippable(config))
    return model.eval()


def load_language(
    model_dir: Path,
    dtype: torch.dtype,
    device: str,
    attention: AttentionBackend | None = None,
    tp: TensorParallel | None = None,
) -> Any:
    """The family's decoder + LM head (P/D stages); reads only its language tensors.
    ``tp``: only this rank's slice of them (``parallel/sharding.py``); ``attention`` must
    then be built for the rank's heads."""
    family = family_of(Path(model_dir))
    config = family.load_config(Path(model_dir))
    _, language_class = family.classes()
    with torch.device("meta"):
        if tp is None:
            language = language_class(config, attention)
        else:
            language = parallelize(language_class(shard_config(config, tp.shard), attention), tp)
    language = _materialise(language, dtype, device)
    layout = family.layout
    _fill(
        language,
        Path(model_dir),
        family,
        layout.language_prefixes,
        layout.language_skippable,
        tp.shard if tp is not None else None,
    )
    return language.eval()


def _materialise(model: _M, dtype: torch.dtype, device: str) -> _M:
    """Meta-device module -> uninitialised storage of ``dtype`` on ``device`` (filled next)."""
    return model.to(dtype=dtype).to_empty(device=device)


def required_tensors(model: nn.Module, family: ModelFamily | None = None) -> dict[str, list[str]]:
    """Our parameter name -> the hub tensor names it is made of (several for fused ones)."""
    config: Any = model.config
    if family is None:
        from epd_engine.model.registry import FAMILIES

        family = next(f for f in FAMILIES if isinstance(config, f.config_class))
    layout = family.layout
    vision_class, _ = family.classes()
    if isinstance(model, vision_class):
        return {name: _sources(layout.vision_source(name)) for name, _ in model.named_parameters()}
    return {
        name: _sources(layout.language_source(config, name)) for name, _ in model.named_parameters()
    }


def _sources(canonical: str) -> list[str]:
    for fused, parts in _FUSED:
        if fused in canonical:
            return [canonical.replace(fused, part) for part in parts]
    return [canonical]


def _fill(
    model: nn.Module,
    model_dir: Path,
    family: ModelFamily,
    own_prefixes: tuple[str, ...],
    is_skippable: Callable[[str], bool],
    shard: Shard | None = None,
) -> None:
    """Copy every parameter from the checkpoint (``shard``: the rank's slice of it); error on
    missing or unexpected tensors."""
    layout = family.layout
    locations = checkpoint_locations(model_dir, layout)  # canonical -> (file, stored name)
    wanted = required_tensors(model, family)
    needed = {src for srcs in wanted.values() for src in srcs}
    missing = sorted(src for src in needed if src not in locations)
    if missing:
        raise ModelFormatError(f"{model_dir}: missing tensors: {_listing(missing)}")
    all_prefixes = (*layout.language_prefixes, *layout.vision_prefixes)
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
    owners: dict[str, list[str]] = defaultdict(list)  # several when weights are tied
    for name, srcs in wanted.items():
        for src in srcs:
            owners[src].append(name)
    uses = {src: len(names) for src, names in owners.items()}  # parameters still to fill
    params = dict(model.named_parameters())
    loaded: dict[str, torch.Tensor] = {}
    for file, names in sorted(by_file.items()):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for src in sorted(names):
                loaded[src] = handle.get_tensor(locations[src][1])
                # Copy once all parts of a parameter are read: host copies do not pile up.
                for param_name in owners[src]:
                    parts = wanted[param_name]
                    if not all(part in loaded for part in parts):
                        continue
                    values = [loaded[part] for part in parts]
                    if shard is not None:
                        values = shard.cut(param_name, values)
                    _copy(params[param_name], values, param_name, parts)
                    for part in parts:
                        uses[part] -= 1
                        if not uses[part]:
                            del loaded[part]


def _copy(param: nn.Parameter, parts: list[torch.Tensor], name: str, srcs: list[str]) -> None:
    value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    if value.shape != param.shape:
        raise ModelFormatError(
            f"tensor {', '.join(srcs)} has shape {tuple(value.shape)}, "
            f"expected {tuple(param.shape)} for {name}"
        )
    with torch.no_grad():
        param.copy_(value)


def checkpoint_locations(model_dir: Path, layout: CheckpointLayout) -> dict[str, tuple[Path, str]]:
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
        locations[layout.canonical(name)] = (file, name)
    return locations


def _listing(names: list[str], limit: int = 8) -> str:
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
