"""How a language model is cut across tensor-parallel ranks (Megatron's layout, as vLLM's).

Each rank holds ``1/size`` of the attention heads (query and KV alike, so its KV cache holds
its heads' pages only), ``1/size`` of the MLP's intermediate width and ``1/size`` of the
vocabulary. The fused projections that read the replicated hidden state (``qkv_proj``,
``gate_up_proj``) are cut along their output rows, each fused part on its own; the ones
that write it (``o_proj``, ``down_proj``) along their input columns, and their partial sums
are all-reduced. The embedding and the LM head are cut by vocabulary rows, the vocabulary
padded to a multiple of ``size``. Norms, biases of row-parallel layers (none in our families)
and the vision tower stay whole.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from epd_engine.config import TENSOR_PARALLEL_SIZES as SIZES
from epd_engine.parallel.sizing import CUT_FIELDS, fitting_sizes, undivided

_C = TypeVar("_C")

# cut along output rows; a fused one part by part (q, k, v; gate, up), as the loader reads them
COLUMN_PARALLEL = (".qkv_proj.weight", ".qkv_proj.bias", ".gate_up_proj.weight")
ROW_PARALLEL = (".o_proj.weight", ".down_proj.weight")
VOCAB_PARALLEL = ("embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class Shard:
    """Which slice of the model this rank holds."""

    rank: int
    size: int
    vocab_size: int  # the checkpoint's, before padding

    @property
    def vocab_rows(self) -> int:
        """Vocabulary rows per rank (the vocabulary padded to a multiple of ``size``)."""
        return -(-self.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    def cut(self, param_name: str, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's slice of each checkpoint tensor making up ``param_name`` (several for
        a fused parameter whose parts are stored apart; one when they are stored fused)."""
        if self.size == 1:
            return parts
        if param_name.endswith(VOCAB_PARALLEL):
            return [self._vocab_rows(part) for part in parts]
        if param_name.endswith(COLUMN_PARALLEL):  # the loader reads fused ones by part
            return [part.chunk(self.size, dim=0)[self.rank] for part in parts]
        if param_name.endswith(ROW_PARALLEL):
            return [part.chunk(self.size, dim=1)[self.rank] for part in parts]
        return parts

    def _vocab_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        start = self.vocab_start
        rows = tensor[start : start + self.vocab_rows]
        missing = self.vocab_rows - rows.shape[0]  # the padding of the last rank
        if missing:
            rows = torch.cat((rows, rows.new_zeros(missing, *rows.shape[1:])))
        return rows


def check_divisible(config: Any, size: int) -> None:
    """Refuse a size the model cannot be cut into, naming what does not divide."""
    if size not in SIZES:
        raise ValueError(f"tensor parallel size must be one of {SIZES}, got {size}")
    reason = undivided(_cut_values(config), size, "the model's")
    if reason is not None:
        raise ValueError(f"tensor parallel size {reason}")


def divisors_of(config: Any) -> list[int]:
    """The sizes in ``SIZES`` this model's heads and MLP divide by."""
    return fitting_sizes(_cut_values(config))


def _cut_values(config: Any) -> dict[str, int]:
    return {field: int(getattr(config, field)) for field in CUT_FIELDS}


def shard_config(config: _C, shard: Shard) -> _C:
    """The config one rank builds its language model from: its heads, MLP width and
    vocabulary rows (``head_dim`` and the hidden width stay whole)."""
    if shard.size == 1:
        return config
    check_divisible(config, shard.size)
    c: Any = config
    return dataclasses.replace(
        c,
        num_heads=c.num_heads // shard.size,
        num_kv_heads=c.num_kv_heads // shard.size,
        intermediate_size=c.intermediate_size // shard.size,
        vocab_size=shard.vocab_rows,
    )
