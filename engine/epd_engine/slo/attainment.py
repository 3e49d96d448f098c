"""SLO attainment (HydraInfer's definition).

A request meets the SLO when it succeeded, its TTFT <= the TTFT SLO and 90% of its
inter-token gaps are <= the TPOT SLO (its nearest-rank p90 gap <= TPOT SLO). Attainment is
the share of *all* requests that meet it: failed or unfinished requests count as misses.
Works on any object with ``ok``, ``ttft_s`` and ``tpot_p90_s`` so the simulator can pass its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from epd_engine.config import SLO


class LatencySample(Protocol):
    """What the SLO check needs from one request (``RequestResult`` is one)."""

    @property
    def ok(self) -> bool: ...

    @property
    def ttft_s(self) -> float | None: ...

    @property
    def tpot_p90_s(self) -> float: ...


def meets_slo(sample: LatencySample, slo: SLO) -> bool:
    if not sample.ok or sample.ttft_s is None:
        return False
    return meets(sample.ttft_s, sample.tpot_p90_s, slo)


def meets(ttft_s: float, tpot_p90_s: float, slo: SLO) -> bool:
    """A request that succeeded meets the SLO: its TTFT and its p90 gap within it."""
    return ttft_s <= slo.ttft_s and tpot_p90_s <= slo.tpot_s


def attainment(samples: Sequence[LatencySample], slo: SLO) -> float:
    """Share of requests meeting the SLO; 0.0 for an empty run (nothing was served)."""
    if not samples:
        return 0.0
    return sum(meets_slo(s, slo) for s in samples) / len(samples)


def passes(samples: Sequence[LatencySample], slo: SLO) -> bool:
    """Whether a run at some rate counts toward goodput (attainment >= slo.attainment, 0.9)."""
    return attainment(samples, slo) >= slo.attainment - 1e-12
