"""The trace an elastic plan is sized on: the window's requests at a level rate.

Goodput is the highest rate the window's trace, replayed faster or slower as a whole, meets
the SLO at; the sizing compares it with the forecast rate. A window's level changes (a ramp,
a burst that is over) are what the forecast reads; left in the replayed trace they count a
second time: after a drop, the old burst replayed at the low forecast rate still outruns one
instance, and the loop sized two for a flat rate one serves (a real-engine run went 3 -> 1 ->
2 at 0.4 rps). So the sizing replays the window with its level changes taken out: each
sub-window of the forecast's (``forecast.num_bins``) is stretched or squeezed to the window's
mean rate, keeping its requests, their order and their spacing within it (the bursts a
Poisson load has at any level).
"""

from __future__ import annotations

from collections.abc import Sequence

from epd_engine.contracts.trace import TraceRecord, sort_by_arrival
from epd_operator.planning.forecast import num_bins


def levelled(records: Sequence[TraceRecord]) -> list[TraceRecord]:
    """``records`` re-timed so that every sub-window between the first and the last arrival
    has the window's mean rate; the first arrival and the span are kept."""
    ordered = sort_by_arrival(records)
    start = ordered[0].arrival_s if ordered else 0.0
    span = ordered[-1].arrival_s - start if ordered else 0.0
    if span <= 0:
        return ordered
    bins = num_bins(len(ordered))
    width = span / bins
    index = [min(bins - 1, int((r.arrival_s - start) / width)) for r in ordered]
    counts = [index.count(k) for k in range(bins)]
    per_request = span / len(ordered)  # the new length of a sub-window is its count of these
    new_start = [sum(counts[:k]) * per_request for k in range(bins)]
    out = []
    for r, k in zip(ordered, index, strict=True):
        within = (r.arrival_s - start - k * width) / width
        at = start + new_start[k] + within * counts[k] * per_request
        out.append(r.model_copy(update={"arrival_s": at}))
    return out
