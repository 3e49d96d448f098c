"""Calibrated overheads as the simulator applies them: fixed medians, or seeded draws from
their empirical quantiles (same seed, same run: simulations stay deterministic)."""

from __future__ import annotations

import random

from epd_engine.profiler.cost_model import Overheads


class Jitter:
    def __init__(self, overheads: Overheads, seed: int = 0) -> None:
        self.overheads = overheads
        self._rng = random.Random(seed)

    def request_s(self) -> float:
        options = self.overheads.request_s_quantiles
        return self._rng.choice(options) if options else self.overheads.request_s

    def step_s(self) -> float:
        options = self.overheads.step_s_quantiles
        return self._rng.choice(options) if options else self.overheads.step_s
