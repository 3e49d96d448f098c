"""Goodput on a shared geometric grid of rates, and the search state of one candidate.

Every candidate's goodput is a grid rate ``r_k = base * (1 + step)^k``: the highest ``k`` at
which the simulated trace passes the SLO (with ``k`` no higher than the plan's capacity
bound). ``step`` is the search's relative precision, as the old bisection's tolerance was.
Because all candidates share the grid, comparing two plans is comparing two integers, and
"can this plan beat the best?" is one simulation at one grid rate: the exact question the
exhaustive search asks, not an approximation of it (docs/planning.md, "Exact and fast").

A ``Bracket`` holds what is known of one candidate (highest passing index, lowest failing
one) and proposes the next index to simulate; several may be in flight at once (workers):
down from the bound in doubling steps until something passes, then bisection.
It assumes, as every goodput search does, that attainment falls as the rate grows.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from epd_engine.slo.goodput import RatePoint

MAX_RPS = 1e6  # the grid's ceiling when a plan has no finite bound
DEPTH = 512.0  # failing at bound / DEPTH means goodput 0 (the old bisection's min_rps)


@dataclass(frozen=True)
class RateGrid:
    step: float = 0.05
    base_rps: float = 1.0

    def __post_init__(self) -> None:
        if self.step <= 0:
            raise ValueError(f"the grid step (relative tolerance) must be > 0, got {self.step}")

    def rate(self, index: int) -> float:
        return self.base_rps * (1 + self.step) ** index

    def floor_index(self, rps: float) -> int:
        """The highest index whose rate is <= ``rps`` (float-safe)."""
        rps = min(rps, MAX_RPS)
        index = math.floor(math.log(rps / self.base_rps) / math.log1p(self.step))
        while self.rate(index + 1) <= rps * (1 + 1e-12):
            index += 1
        while self.rate(index) > rps * (1 + 1e-12):
            index -= 1
        return index

    def span(self, factor: float) -> int:
        """Indices covering a rate ratio of ``factor``."""
        return math.ceil(math.log(factor) / math.log1p(self.step))

    def bracket(self, bound_rps: float, start_rps: float | None = None) -> Bracket:
        """A fresh search for a plan whose goodput is at most ``bound_rps``."""
        top = self.floor_index(bound_rps)
        start = None if start_rps is None else self.floor_index(start_rps)
        return Bracket(top, top - self.span(DEPTH), start=start)


@dataclass
class Bracket:
    """The search state of one candidate on the grid.

    ``top``: the bound's index (goodput never above it); ``bottom``: failing there means
    goodput 0. ``floor``: the candidate only matters if it passes there (it must beat the
    best so far); None while there is no best. ``passed`` / ``failed``: the highest passing
    and lowest failing index simulated.
    """

    top: int
    bottom: int
    floor: int | None = None
    start: int | None = None  # where a first search probes first (a re-plan's hint)
    passed: int | None = None
    failed: int | None = None
    in_flight: set[int] = field(default_factory=set)
    points: dict[int, RatePoint] = field(default_factory=dict)

    def record(self, index: int, point: RatePoint) -> None:
        self.in_flight.discard(index)
        self.points[index] = point
        if point.passed:
            if self.failed is None or index < self.failed:  # a pass above a fail is noise
                self.passed = index if self.passed is None else max(self.passed, index)
        else:
            self.failed = index if self.failed is None else min(self.failed, index)
            if self.passed is not None and self.passed >= self.failed:
                self.passed = max((k for k, p in self.points.items() if p.passed and k < index),
                                  default=None)  # fmt: skip

    @property
    def exact(self) -> bool:
        """The goodput index is known: ``passed`` (or nothing passes)."""
        if self.failed is not None and self.failed <= self.bottom:
            return True
        if self.passed is None:
            return False
        return self.passed >= self.top or (
            self.failed is not None and self.failed <= self.passed + 1
        )

    @property
    def below_floor(self) -> bool:
        """It failed at or under the floor: it cannot beat the best, its exact goodput is moot."""
        if self.floor is None:
            return False
        return self.floor > self.top or (self.failed is not None and self.failed <= self.floor)

    @property
    def settled(self) -> bool:
        return self.exact or self.below_floor

    def next_probe(self, max_in_flight: int) -> int | None:
        """The next index worth simulating, or None (settled, or waiting on ``in_flight``)."""
        if self.settled or len(self.in_flight) >= max_in_flight:
            return None
        if self.floor is not None and self.passed is None:
            # First the one question that matters: does it beat the best (pass at the floor)?
            probe = max(self.floor, self.bottom)
            return None if probe in self.in_flight else probe
        if self.start is not None:  # a re-plan's hint: its goodput, then one step either way
            start = max(self.bottom, min(self.top, self.start))
            if start not in self.points:
                return None if start in self.in_flight else start
            step = start + 1 if self.points[start].passed else start - 1
            if (
                step not in self.points
                and step not in self.in_flight
                and self.bottom <= step <= self.top
            ):
                return step
        high = self.failed if self.failed is not None else self.top + 1
        if self.passed is None:
            return self._gallop(high)
        low = self.passed
        marks = sorted({low, high, *(k for k in self.in_flight if low < k < high)})
        gaps = [(b - a, a, b) for a, b in itertools.pairwise(marks)]
        width, a, b = max(gaps, key=lambda g: (g[0], g[1]))  # widest; the higher on ties
        if width <= 1:
            return None
        return (a + b) // 2

    def _gallop(self, high: int) -> int | None:
        """No pass yet: down from the bound in doubling steps (top, top-1, top-3, top-7, ...).

        The bound is usually tight (mixed traces: goodput one or two indices under it), so
        the first two probes often settle the search, and a probe over capacity is cheap: it
        stops as soon as the SLO is lost. Bisection starts once something passes."""
        lowest = min([high, *self.in_flight])
        if lowest <= self.bottom:
            return None
        return max(self.bottom, lowest - max(1, self.top + 1 - lowest))
