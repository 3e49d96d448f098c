"""What a ``ModelRunner`` of a tensor-parallel instance asks of its rank group.

Rank 0's runner tells the others each language-model call as it makes it, and hands them
the image rows it read from its image cache (the only one: images are encoded and cached on
rank 0, ``ranks.py``); the other ranks' runners make the same calls on their slices.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from epd_engine.model.mrope import MRopeState
from epd_engine.scheduler.output import TokenTask


class RanksOutOfStep(RuntimeError):
    """A rank died, timed out or failed mid-call: the ranks can no longer run a step
    together, so the instance is out of service until it restarts (``device_errors.py``)."""


class RankLink(Protocol):
    def forward_starts(
        self, tasks: list[TokenTask], rope_of: Mapping[str, MRopeState], then_logits: bool
    ) -> None:
        """Before a forward over ``tasks``, and the LM head after it when ``then_logits``
        (rank 0 announces it; the others were told)."""
        ...

    def logits_start(self) -> None:
        """Before the LM head over the last forward's sampled rows, unless the forward said."""
        ...

    def image_rows(
        self, rows: torch.Tensor | None, count: int, row_size: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """The step's image rows ``[count, row_size]`` on every rank: rank 0 passes what it
        read, the others ``None`` and get rank 0's."""
        ...

    def call_failed(self, exc: BaseException) -> RanksOutOfStep:
        """A call raised after it was announced: the ranks are out of step."""
        ...
