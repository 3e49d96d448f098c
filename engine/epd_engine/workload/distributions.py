"""Small seeded length distributions for workload generators (prompt, output, images)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class IntDist(Protocol):
    """A distribution of non-negative integers with a known nominal mean."""

    @property
    def mean(self) -> float: ...

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray: ...


@dataclass(frozen=True)
class Fixed:
    value: int

    @property
    def mean(self) -> float:
        return float(self.value)

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return np.full(size, self.value, dtype=np.int64)


@dataclass(frozen=True)
class Uniform:
    """Integers uniform in [low, high] inclusive."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 0 <= self.low <= self.high:
            raise ValueError(f"need 0 <= low <= high, got {self.low}, {self.high}")

    @property
    def mean(self) -> float:
        return (self.low + self.high) / 2

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return rng.integers(self.low, self.high + 1, size=size, dtype=np.int64)


@dataclass(frozen=True)
class LogNormal:
    """Right-skewed lengths (text, answers): lognormal with this mean and CV, clipped to bounds.

    Clipping moves the empirical mean a little; bounds are chosen wide enough that it stays
    within a few percent of ``mean``.
    """

    mean_value: float
    cv: float
    low: int = 1
    high: int = 1_000_000

    def __post_init__(self) -> None:
        if self.mean_value <= 0 or self.cv <= 0 or self.low > self.high:
            raise ValueError(f"invalid LogNormal({self.mean_value}, cv={self.cv})")

    @property
    def mean(self) -> float:
        return self.mean_value

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        sigma2 = math.log1p(self.cv**2)
        mu = math.log(self.mean_value) - sigma2 / 2
        values = rng.lognormal(mu, math.sqrt(sigma2), size=size)
        return np.clip(np.rint(values), self.low, self.high).astype(np.int64)


@dataclass(frozen=True)
class Choice:
    """One of ``values`` with ``weights`` (normalised)."""

    values: Sequence[int]
    weights: Sequence[float] | None = None

    @property
    def mean(self) -> float:
        weights = np.asarray(self.weights if self.weights else [1.0] * len(self.values))
        return float(np.dot(self.values, weights / weights.sum()))

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        p = None
        if self.weights:
            weights = np.asarray(self.weights, dtype=float)
            p = weights / weights.sum()
        return rng.choice(np.asarray(self.values, dtype=np.int64), size=size, p=p)


@dataclass(frozen=True)
class SizeChoice:
    """Image (width, height) buckets with weights: datasets have a few dominant resolutions."""

    sizes: Sequence[tuple[int, int]]
    weights: Sequence[float] | None = None

    def sample(self, rng: np.random.Generator, size: int) -> list[tuple[int, int]]:
        p = None
        if self.weights:
            weights = np.asarray(self.weights, dtype=float)
            p = weights / weights.sum()
        idx = rng.choice(len(self.sizes), size=size, p=p)
        return [self.sizes[int(i)] for i in idx]

    @property
    def mean_pixels(self) -> float:
        weights = np.asarray(self.weights if self.weights else [1.0] * len(self.sizes))
        pixels = np.asarray([w * h for w, h in self.sizes], dtype=float)
        return float(np.dot(pixels, weights / weights.sum()))
