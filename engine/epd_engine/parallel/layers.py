"""The layers whose outputs cross ranks, and ``parallelize``, which puts them in a language
model built from a rank's config (``sharding.shard_config``).

Every other module runs as it is on its own slice: attention sees its rank's heads, the MLP
its rank's intermediate width. One all-reduce after each sub-layer (``o_proj``,
``down_proj``), one after the embedding and one all-gather of the logits, as Megatron-LM.
The collectives go through ``torch.distributed`` (gloo on a CPU, NCCL on GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from epd_engine.parallel.sharding import ROW_PARALLEL, Shard


@dataclass(frozen=True)
class TensorParallel:
    """This rank's slice and the group its collectives run in."""

    shard: Shard
    group: Any  # torch.distributed.ProcessGroup

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x


class RowParallelLinear(nn.Linear):
    """``x @ W[:, rank's columns].T``, summed over ranks: the input is already cut (the
    rank's heads or intermediate width), the output is whole on every rank."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(F.linear(x, self.weight))


class VocabParallelEmbedding(nn.Embedding):
    """The rank's vocabulary rows; a token held elsewhere embeds to zero here, and the sum
    over ranks is every token's row."""

    def __init__(self, rows: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__(rows, hidden_size)
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        start = self.tp.shard.vocab_start
        local = ids - start
        outside = (local < 0) | (local >= self.num_embeddings)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        rows.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(rows)


class VocabParallelHead(nn.Linear):
    """Logits of the rank's vocabulary rows, gathered: every rank ends with all of them
    (the padding rows cut off), so any rank could sample."""

    def __init__(self, hidden_size: int, rows: int, tp: TensorParallel) -> None:
        super().__init__(hidden_size, rows, bias=False)
        self.tp = tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, H] -> [S, V]
        local = F.linear(hidden, self.weight).contiguous()  # [S, V / size]
        pieces = [torch.empty_like(local) for _ in range(self.tp.shard.size)]
        dist.all_gather(pieces, local, group=self.tp.group)
        return torch.cat(pieces, dim=-1)[..., : self.tp.shard.vocab_size]


def parallelize(language: nn.Module, tp: TensorParallel) -> nn.Module:
    """Swap in the cross-rank layers (before the weights are filled: parameter names stay
    the checkpoint's). ``language`` was built from ``shard_config``, so its shapes are the
    rank's already."""
    for name, module in list(language.named_modules()):
        if not isinstance(module, nn.Linear) or not name.startswith("layers."):
            continue
        if f".{name}.weight".endswith(ROW_PARALLEL):
            if module.bias is not None:
                raise ValueError(f"{name}: a row-parallel layer with a bias is not supported")
            _replace(language, name, RowParallelLinear(module.in_features,
                                                       module.out_features, tp))  # fmt: skip
    embed: Any = language.embed_tokens
    language.embed_tokens = VocabParallelEmbedding(embed.num_embeddings, embed.embedding_dim, tp)
    head: Any = language.lm_head
    language.lm_head = VocabParallelHead(head.in_features, head.out_features, tp)
    return language


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)
