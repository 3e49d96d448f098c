"""SLO attainment (HydraInfer's definition).

A request meets the SLO when it succeeded, its TTFT <= the TTFT SLO and 90% of its
inter-token gaps are <= the TPOT SLO (its nearest-rank p90 gap <= TPOT SLO). Attainment is
the share of *all* requests that meet it: failed or unfinished requests count as misses.
Works on any object with ``ok``, ``ttft_s`` and ``tpot_p90_s`` so the simulator can pass its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


def meets_slo(
    sample: LatencySample, slo: SLO, tpot_p90: Callable[[LatencySample], float] | None = None
) -> bool:
    """``tpot_p90``: the sample's p90 gap when the caller knows it already (it sorts gaps)."""
    if not sample.ok or sample.ttft_s is None:
        return False
    p90 = sample.tpot_p90_s if tpot_p90 is None else tpot_p90(sample)
    return sample.ttft_s <= slo.ttft_s and p90 <= slo.tpot_s


def attainment(
    samples: Sequence[LatencySample],
    slo: SLO,
    tpot_p90: Callable[[LatencySample], float] | None = None,
) -> float:
    """Share of requests meeting the SLO; 0.0 for an empty run (nothing was served)."""
    if not samples:
        return 0.0
    return sum(meets_slo(s, slo, tpot_p90) for s in samples) / len(samples)


def passes(samples: Sequence[LatencySample], slo: SLO) -> bool:
    """Whether a run at some rate counts toward goodput (attainment >= slo.attainment, 0.9)."""
    return attainment(samples, slo) >= slo.attainment - 1e-12
