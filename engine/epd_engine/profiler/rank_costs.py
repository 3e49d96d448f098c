"""What a cost model records for splitting its language model over tensor-parallel ranks:
the collectives' shapes, the link they run over, the weights a rank sheds and the sizes the
model can be cut into. The plan search projects each role's cost at a size from it
(``tensor_parallel.sized``); a cost model without it is planned at one rank only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from epd_engine.profiler.links import LinkCoeffs


@dataclass(frozen=True)
class RankedShape:
    """What the collectives of one step carry, from the model's config."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    dtype_bytes: int

    @classmethod
    def of(cls, config: Any, dtype_bytes: int) -> RankedShape:
        return cls(config.num_layers, config.hidden_size, config.vocab_size, dtype_bytes)

    @property
    def messages(self) -> int:
        """Per step: two all-reduces a layer, one after the embedding, the logits' gather,
        and rank 0's call to the other ranks (its size, then its body)."""
        return 2 * self.num_layers + 4


@dataclass(frozen=True)
class RankCosts:
    shape: RankedShape
    link: LinkCoeffs  # the ranks' collective link (NVLink within a GPU node)
    weight_bytes: int  # the language model's weights: a rank of N holds 1/N of them
    sizes: tuple[int, ...]  # the sizes its heads and MLP divide by (``parallel/sizing``)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankCosts:
        return cls(
            shape=RankedShape(**data["shape"]),
            link=LinkCoeffs(**data["link"]),
            weight_bytes=int(data["weight_bytes"]),
            sizes=tuple(int(s) for s in data["sizes"]),
        )
