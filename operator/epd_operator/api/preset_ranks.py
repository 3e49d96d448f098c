"""Whether a preset model can be cut into a role's tensor-parallel ranks (its heads and MLP
width must divide by the size). The API server cannot know a checkpoint's heads; for the
presets the operator does, so a bad size is refused at ``epdctl apply`` and in the status
before any pod starts. Other checkpoints are checked by the engine as it starts, with the
same rule (``epd_engine/parallel/sizing.py``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from epd_engine.model.gemma3_preset import GEMMA3_PRESETS
from epd_engine.model.presets import PRESETS
from epd_engine.model.qwen2_vl_preset import QWEN2_VL_PRESETS
from epd_engine.model.qwen3_vl_preset import QWEN3_VL_PRESETS
from epd_engine.parallel.sizing import CUT_FIELDS, undivided

_CONFIG_NAMES = {  # what the engine cuts -> its config.json name
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "intermediate_size": "intermediate_size",
}


def preset_text_config(preset: str) -> dict[str, Any]:
    presets: dict[str, Any] = {**PRESETS, **QWEN2_VL_PRESETS, **QWEN3_VL_PRESETS, **GEMMA3_PRESETS}
    config: dict[str, Any] = presets[preset].text_config
    return config


def _cut_values(preset: str) -> dict[str, int]:
    text = preset_text_config(preset)
    return {ours: int(text.get(_CONFIG_NAMES[ours]) or text["num_attention_heads"])
            for ours in CUT_FIELDS}  # fmt: skip


def check_preset_sizes(preset: str | None, sizes: Iterable[tuple[str, int]]) -> None:
    """Refuse any size the preset's heads or MLP width do not divide by (``sizes``: each
    with the field that sets it), naming the field and the sizes that would."""
    if preset is None:
        return
    values = _cut_values(preset)
    for field, size in sizes:
        reason = undivided(values, size, f"preset {preset}'s")
        if reason is not None:
            raise ValueError(f"{field}: {reason}")
