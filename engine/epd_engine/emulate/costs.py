"""What an emulated instance takes from its cost model: step times and migration bytes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from epd_engine.profiler.cost_model import BatchShape, FittedCostModel
from epd_engine.profiler.reference import named_cost_model
from epd_engine.scheduler.output import SchedulerOutput


@dataclass(frozen=True)
class EmulatedCosts:
    """A fitted cost model read as a clock: how long a batch runs, how many bytes a migration
    moves and how long that takes over the model's link."""

    model: FittedCostModel
    source: str  # the file it came from (shown in metrics and the ready answer)

    @classmethod
    def load(cls, name: str | Path) -> EmulatedCosts:
        """A cost model JSON file, or ``reference[:MODEL]`` (a built-in synthetic one)."""
        return cls(named_cost_model(name), str(name))

    def step_s(self, out: SchedulerOutput) -> float:
        """The runner's time for this batch (the engine loop's own overhead is real here)."""
        if out.is_empty:
            return 0.0
        return max(0.0, self.model.runner_step_s(BatchShape.of(out)))

    def migration_bytes(self, kind: str, num_tokens: int) -> int:
        link = self.model.migration
        if kind == "image":
            return num_tokens * link.image_bytes_per_token
        return link.kv_bytes(num_tokens)

    def migration_s(self, kind: str, num_tokens: int) -> float:
        return self.model.migration.at(kind, num_tokens)
