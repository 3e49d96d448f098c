"""Calibrated overheads as the simulator applies them: fixed medians, or seeded draws from
their empirical quantiles (same seed, same run: simulations stay deterministic); the hand-off
and pull overheads times the plan's CPU share on a shared host, the request and per-iteration
step overheads as measured (``Overheads``)."""

from __future__ import annotations

import random

from epd_engine.profiler.cost_model import Overheads


class Jitter:
    def __init__(self, overheads: Overheads, seed: int = 0, cpu_share: float = 1.0) -> None:
        self.overheads = overheads
        self.cpu_share = cpu_share
        self._rng = random.Random(seed)

    def _draw(self, median: float, options: tuple[float, ...], share: float) -> float:
        value = self._rng.choice(options) if options else median
        return value * share

    def request_s(self) -> float:
        o = self.overheads
        return self._draw(o.request_s, o.request_s_quantiles, 1.0)  # not per share

    def step_s(self) -> float:
        o = self.overheads
        return self._draw(o.step_s, o.step_s_quantiles, 1.0)  # not per share, nor its stalls

    def handoff_s(self) -> float:
        o = self.overheads
        return self._draw(o.handoff_s, o.handoff_s_quantiles, self.cpu_share)

    def image_handoff_s(self) -> float:
        o = self.overheads
        if not (o.image_handoff_s or o.image_handoff_s_quantiles):  # calibrated before
            return self.handoff_s()
        return self._draw(o.image_handoff_s, o.image_handoff_s_quantiles, self.cpu_share)

    def pull_s(self) -> float:
        o = self.overheads
        return self._draw(o.pull_s, o.pull_s_quantiles, self.cpu_share)

    def kv_pull_s(self) -> float:
        o = self.overheads
        if not (o.kv_pull_s or o.kv_pull_s_quantiles):  # calibrated before KV had its own
            return self.pull_s()
        return self._draw(o.kv_pull_s, o.kv_pull_s_quantiles, self.cpu_share)
