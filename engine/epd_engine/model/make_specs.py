"""Tensor specs and deterministic random values for made-up checkpoints (any family).

Each tensor gets values from its own seed, so they do not depend on the shard layout. The
init keeps activations at unit scale and gives logits a spread of a few units, so greedy
argmax is decided by the weights, not by float rounding: parity tests stay stable.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

LOGIT_SCALE = 4.0  # std of logits for unit-RMS final hidden states


@dataclass(frozen=True)
class TensorSpec:
    name: str  # hub name
    shape: tuple[int, ...]
    init: str  # "normal" (std given) | "norm_weight" | "bias"
    std: float = 1.0

    @property
    def numel(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n


def linear(name: str, fan_out: int, fan_in: int, bias: bool, gain: float = 1.0) -> list[TensorSpec]:
    specs = [TensorSpec(f"{name}.weight", (fan_out, fan_in), "normal", gain / fan_in**0.5)]
    if bias:
        specs.append(TensorSpec(f"{name}.bias", (fan_out,), "bias"))
    return specs


def norm(name: str, hidden: int, bias: bool) -> list[TensorSpec]:
    specs = [TensorSpec(f"{name}.weight", (hidden,), "norm_weight")]
    if bias:
        specs.append(TensorSpec(f"{name}.bias", (hidden,), "bias"))
    return specs


def random_tensor(spec: TensorSpec, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Deterministic per (seed, name): the same tensor whatever the shard layout."""
    import torch  # here: the presets' shapes are read where torch is not installed (operator)

    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(spec.name.encode()))
    values = torch.randn(spec.shape, generator=generator)
    if spec.init == "norm_weight":
        values = 1.0 + 0.1 * values  # near 1, but not exactly: a skipped norm changes logits
    elif spec.init == "bias":
        values = 0.1 * values
    else:
        values = spec.std * values
    return values.to(dtype)


def plan_shards(
    specs: list[TensorSpec], bytes_per_value: int, max_shard_bytes: int
) -> list[list[TensorSpec]]:
    """Greedy consecutive groups of at most ``max_shard_bytes`` (one tensor may exceed it)."""
    shard: list[TensorSpec] = []
    shard_bytes = 0
    shards: list[list[TensorSpec]] = []
    for spec in specs:
        size = spec.numel * bytes_per_value
        if shard and shard_bytes + size > max_shard_bytes:
            shards.append(shard)
            shard, shard_bytes = [], 0
        shard.append(spec)
        shard_bytes += size
    if shard:
        shards.append(shard)
    return shards
