"""Arrival processes: Poisson (HydraInfer v1), gamma-bursty, uniform, and replayed timestamps
scaled to a rate (HydraInfer v2 scales production inter-arrival times the same way).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from epd_engine.contracts.trace import TraceRecord, mean_rate_rps, sort_by_arrival

ArrivalKind = Literal["poisson", "gamma", "uniform"]


def poisson_arrivals(num: int, rate_rps: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times (s) of a Poisson process: exponential gaps, first request at 0."""
    return gamma_arrivals(num, rate_rps, 1.0, rng)


def gamma_arrivals(num: int, rate_rps: float, cv: float, rng: np.random.Generator) -> np.ndarray:
    """Gamma-distributed gaps with mean 1/rate and coefficient of variation ``cv``.

    cv = 1 is Poisson; cv > 1 is bursty (clusters then lulls); cv < 1 is smoother.
    Shape k = 1/cv², scale = 1/(rate·k) keeps the mean gap at 1/rate.
    """
    _check(num, rate_rps)
    if cv <= 0:
        raise ValueError(f"cv must be > 0, got {cv}")
    if num == 0:
        return np.zeros(0)
    shape = 1.0 / cv**2
    gaps = rng.gamma(shape, 1.0 / (rate_rps * shape), size=num - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def uniform_arrivals(num: int, rate_rps: float) -> np.ndarray:
    """Evenly spaced arrivals (deterministic; for tests and closed-form checks)."""
    _check(num, rate_rps)
    return np.arange(num) / rate_rps


def _check(num: int, rate_rps: float) -> None:
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    if rate_rps <= 0:
        raise ValueError(f"rate must be > 0 req/s, got {rate_rps}")


@dataclass(frozen=True)
class ArrivalSpec:
    """How requests arrive: ``kind`` at ``rate_rps`` (``cv`` only for gamma)."""

    kind: ArrivalKind = "poisson"
    rate_rps: float = 1.0
    cv: float = 1.0

    def __post_init__(self) -> None:
        _check(0, self.rate_rps)
        if self.kind not in ("poisson", "gamma", "uniform"):
            raise ValueError(f"unknown arrival kind {self.kind!r}; use poisson, gamma or uniform")

    def sample(self, num: int, seed: int = 0) -> np.ndarray:
        # A separate stream from the workload's so changing arrivals keeps the same requests.
        rng = np.random.default_rng([seed, 1])
        if self.kind == "poisson":
            return poisson_arrivals(num, self.rate_rps, rng)
        if self.kind == "gamma":
            return gamma_arrivals(num, self.rate_rps, self.cv, rng)
        return uniform_arrivals(num, self.rate_rps)


def with_arrivals(
    records: Sequence[TraceRecord], arrivals_s: Sequence[float] | np.ndarray
) -> list[TraceRecord]:
    """Records with ``arrival_s`` replaced, in order."""
    if len(records) != len(arrivals_s):
        raise ValueError(f"{len(records)} records but {len(arrivals_s)} arrival times")
    return [
        r.model_copy(update={"arrival_s": float(t)})
        for r, t in zip(records, arrivals_s, strict=True)
    ]


def scale_time(records: Sequence[TraceRecord], factor: float) -> list[TraceRecord]:
    """Stretch (factor > 1) or compress arrivals around the first one; burst shape is kept."""
    if factor <= 0:
        raise ValueError(f"time scale factor must be > 0, got {factor}")
    ordered = sort_by_arrival(records)
    if not ordered:
        return []
    start = ordered[0].arrival_s
    return [r.model_copy(update={"arrival_s": (r.arrival_s - start) * factor}) for r in ordered]


def at_rate(records: Sequence[TraceRecord], rate_rps: float) -> list[TraceRecord]:
    """Replay the trace's own inter-arrival pattern at ``rate_rps`` (HydraInfer v2 style).

    The first request arrives at 0. A trace with all arrivals equal (e.g. fresh from
    ``generate``) gets evenly spaced arrivals at the rate instead.
    """
    _check(0, rate_rps)
    current = mean_rate_rps(records)
    if current == 0:
        return with_arrivals(records, uniform_arrivals(len(records), rate_rps))
    return scale_time(records, current / rate_rps)
