"""How much a request's front (router, HTTP, the entry instance's preprocessing) stretches
while other requests decode on the same host, read off one measured run.

On a shared host the front is CPU work competing with every other process. In 2-core runs
of tiny-llava (150-200 requests a rate, three methods, five windows) a least-squares fit of
the measured front on the time other requests spent decoding inside it, and on the time
they spent before their first token inside it, gave 0.13-0.41 seconds of front per second
of decoding in E+P+D and EP+D, 0.22-0.52 in EPD (decode in the front's own process), and
0.3-0.6 for the requests before their first token (the simulator's FIFO front models
those). E+P+D's lowest rate alone gave 0.20, 0.20, 0.23, 0.25 and 0.35.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from epd_engine.slo.outcomes import RequestResult

MIN_OVERLAPPED = 3  # fronts that overlapped someone's decode: fewer fit noise, not contention


def front_contention(results: Sequence[RequestResult]) -> float | None:
    """Seconds a measured front grows per second of other requests' decoding inside it: the
    slope of a least-squares fit that also takes out the time others spent before their
    first token, clamped to [0, 1]. None without enough fronts that overlapped a decode.

    ``results`` in the order they were sent, possibly several runs one after the other
    (every rate of a sweep): a run's clock starts at 0, so an earlier arrival than the last
    starts the next run, and overlaps are looked for within one run only. A run's first
    request is cold (``calibrate``): it competes, but its own front is not fitted."""
    rows, fronts = [], []
    for run in _runs(results):
        for index, r in enumerate(run):
            front = (r.stage_s or {}).get("front")
            if index == 0 or front is None:
                continue
            decoding, before_first = _overlaps(run, r, r.arrival_s + front)
            rows.append((1.0, min(decoding, front), min(before_first, front)))
            fronts.append(front)
    if sum(1 for _, decoding, _ in rows if decoding > 0) < MIN_OVERLAPPED:
        return None
    coef, *_ = np.linalg.lstsq(np.array(rows), np.array(fronts), rcond=None)
    return float(min(1.0, max(0.0, coef[1])))


def _runs(results: Sequence[RequestResult]) -> list[list[RequestResult]]:
    runs: list[list[RequestResult]] = []
    for r in results:
        if not runs or r.arrival_s < runs[-1][-1].arrival_s:
            runs.append([])
        runs[-1].append(r)
    return runs


def _overlaps(
    run: Sequence[RequestResult], probe: RequestResult, end: float
) -> tuple[float, float]:
    """Seconds from ``probe``'s arrival to ``end`` the rest of ``run`` spent decoding, and
    before their first token."""
    start = probe.arrival_s
    decoding = before_first = 0.0
    for o in run:
        if o is probe or o.ttft_s is None or o.e2e_s is None:
            continue
        first, done = o.arrival_s + o.ttft_s, o.arrival_s + o.e2e_s
        decoding += max(0.0, min(done, end) - max(first, start))
        before_first += max(0.0, min(first, end) - max(o.arrival_s, start))
    return decoding, before_first
