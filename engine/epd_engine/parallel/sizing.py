"""Tensor-parallel sizing rules, in pure Python (the operator and the planner use them too).

Which sizes a language model can be cut into: its query heads, KV heads and MLP width must
all divide by the size (the operator checks presets with it before any pod starts, the
engine every checkpoint as it loads, ``sharding.py``). How many whole-head staging pages
rank 0 keeps for migrations (``kv_staging.py``; the GPU memory plan and the planner take
them off the KV cache)."""

from __future__ import annotations

from collections.abc import Mapping

from epd_engine.config import TENSOR_PARALLEL_SIZES

# a staging region holds this many tokens, or one longest request if that is more
STAGING_TOKENS = 8192
CUT_FIELDS = ("num_heads", "num_kv_heads", "intermediate_size")  # what each rank holds 1/N of


def fitting_sizes(values: Mapping[str, int]) -> list[int]:
    """The sizes every one of ``values`` (``CUT_FIELDS`` -> count) divides by."""
    return [s for s in TENSOR_PARALLEL_SIZES if all(v % s == 0 for v in values.values())]


def undivided(values: Mapping[str, int], size: int, whose: str) -> str | None:
    """Why ``size`` cannot cut a model with ``values`` (None: it can), naming the field and
    the sizes that would; ``whose`` names the model in the message."""
    for field, value in values.items():
        if value % size:
            return (
                f"{size} does not divide {whose} {field} ({value}); sizes that do: "
                f"{', '.join(map(str, fitting_sizes(values)))}"
            )
    return None


def staging_pages(max_model_len: int, block_size: int) -> int:
    return -(-max(STAGING_TOKENS, max_model_len) // block_size)
