"""What rank 0 tells the other ranks of an instance, one object per call (pickled over the
gloo group ``ranks.py`` keeps for them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from epd_engine.model.mrope import MRopeState
from epd_engine.scheduler.output import TokenTask
from epd_engine.worker.model_runner import CacheShape


@dataclass(frozen=True)
class RunnerSetup:
    """Once, after rank 0 sized its caches: every rank sizes its own slice alike."""

    shape: CacheShape
    max_decode_seqs: int | None
    max_model_len: int | None


@dataclass(frozen=True)
class Forward:
    """Run the language model over these tasks (rank 0 runs the same), then the LM head over
    the sampled rows when ``then_logits`` (a serving step: one call instead of two)."""

    tasks: list[TokenTask]
    rope_of: Mapping[str, MRopeState]
    then_logits: bool = False


@dataclass(frozen=True)
class Logits:
    """Compute the logits of the last forward's sampled rows (the LM head's gather), when
    the forward did not say it would."""


@dataclass(frozen=True)
class GatherPages:
    """Send rank 0 this rank's heads of these KV pages, every layer (a migration's source
    stages them: ``kv_staging.py``)."""

    pages: tuple[int, ...]


@dataclass(frozen=True)
class ScatterPages:
    """Take this rank's heads of these KV pages, layers ``[layer_start, layer_stop)``, from
    rank 0 (a migration's target landed them in staging pages: ``kv_staging.py``)."""

    pages: tuple[int, ...]
    layer_start: int
    layer_stop: int


@dataclass(frozen=True)
class Stop:
    """Rank 0 is closing: exit."""
