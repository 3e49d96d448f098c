"""Per-request bookkeeping of a simulation: token times, errors, path, per-stage seconds,
certain SLO misses.

Stage seconds use the router's names and the engine's rules (``LLMEngine``), so a simulated
report breaks latency down the way a measured one does: ``{stage}_queue`` runs from when the
stage became next on an instance (a migrated request: when the target queued the offer, so
it includes the pull) to its first scheduled work, ``{stage}`` from there until the request
moved past it; ``migration_{kind}`` is the pull.

A token the client sees no text for (``silent``: the fraction of tokens after the first whose
text the server holds back) is no gap of its own: its time folds into the next token's gap,
as the client measures it (one chunk a gap), and the last token flushes what is held.

A request *certainly* misses when its TTFT deadline passed without a first token, when more
of its gaps were late than the p90 rule allows (HydraInfer: 90% of gaps <= TPOT SLO), or
when it failed. ``failed`` turns True once so many missed that attainment cannot pass.
"""

from __future__ import annotations

import math
import operator
import random
from collections.abc import Sequence

from epd_engine.config import SLO
from epd_engine.contracts.trace import TraceRecord
from epd_engine.request import Request
from epd_engine.slo.outcomes import RequestResult

_DECODE = "decode"


def allowed_late_gaps(num_gaps: int) -> int:
    """Late gaps a request may have with nearest-rank p90 still on time (``trace.nearest_rank``)."""
    if num_gaps <= 0:
        return 0
    return num_gaps - max(1, math.ceil(0.9 * num_gaps - 1e-9))


class RequestTracker:
    def __init__(
        self, records: Sequence[TraceRecord], slo: SLO | None, silent: float = 0.0, seed: int = 0
    ) -> None:
        num = len(records)
        self.silent = silent
        self._draw = random.Random(seed).random  # seeded: same run, same gaps
        self.num_silent: list[int] = [0] * num
        self.records = records
        self.slo = slo  # None: never stop early
        self.first_s: list[float | None] = [None] * num
        self.last_s: list[float] = [0.0] * num
        self.gaps: list[list[float]] = [[] for _ in range(num)]
        self.finish_s: list[float | None] = [None] * num
        self.errors: list[str | None] = [None] * num
        self.paths: list[list[str]] = [[] for _ in range(num)]
        self.stage_s: list[dict[str, float]] = [{} for _ in range(num)]  # router's names
        self._ready_s: dict[tuple[int, str], float] = {}  # stage is next, not yet scheduled
        self._started_s: dict[tuple[int, str], float] = {}  # stage is running
        self._requests: dict[int, Request] = {}
        self._late: list[int] = [0] * num
        self._missed: list[bool] = [False] * num
        self._num_missed = 0
        self._max_missed = num - math.ceil((slo.attainment - 1e-12) * num) if slo else num
        self.failed = False

    def request(self, index: int) -> Request:
        return self._requests[index]

    def visit(self, index: int, request: Request, pool: str) -> None:
        self._requests[index] = request
        self.paths[index].append(pool)

    def _add(self, index: int, key: str, seconds: float) -> None:
        self.stage_s[index][key] = self.stage_s[index].get(key, 0.0) + seconds

    def migrated(self, index: int, kind: str, seconds: float) -> None:
        self._add(index, f"migration_{kind}", seconds)

    def stage_ready(self, index: int, stage: str, now: float) -> None:
        key = (index, stage)
        if key not in self._started_s and key not in self._ready_s:
            self._ready_s[key] = now

    def stage_started(self, index: int, stage: str, now: float) -> None:
        ready = self._ready_s.pop((index, stage), None)
        if ready is not None:
            self._started_s[(index, stage)] = now
            self._add(index, f"{stage}_queue", now - ready)

    def decodes_started(self, requests: Sequence[Request], now: float) -> None:
        """``stage_started(index, "decode", now)`` for each request decoding this iteration
        (only a request's first decode here closes a queue: the rest are one lookup each)."""
        ready = self._ready_s
        for request in requests:
            key = (int(request.request_id), _DECODE)
            if key in ready:
                self._started_s[key] = now
                self._add(key[0], "decode_queue", now - ready.pop(key))

    def stage_done(self, index: int, stage: str, now: float) -> None:
        started = self._started_s.pop((index, stage), None)
        if started is not None:
            self._add(index, stage, now - started)

    def tokens(self, request_ids: Sequence[str], now: float) -> None:
        """A token for each request (ids: the record's index), all at ``now``."""
        first_s, last_s, gaps = self.first_s, self.last_s, self.gaps
        tpot_s = self.slo.tpot_s if self.slo is not None else None
        for request_id in request_ids:
            index = int(request_id)
            if first_s[index] is None:
                first_s[index] = now
            else:
                if self.silent and self._draw() < self.silent:
                    self.num_silent[index] += 1
                    continue  # no chunk: the gap runs on to the next token
                gap = now - last_s[index]
                gaps[index].append(gap)
                if tpot_s is not None and gap > tpot_s:
                    self.late_gap(index)
            last_s[index] = now

    def token_run(self, index: int, times: Sequence[float]) -> None:
        """Tokens of a steady decode (``steady_decodes.py``), one at each of ``times``;
        each late gap was counted as it happened (``late_gap``), no token is silent."""
        assert self.first_s[index] is not None, "a steady decode has its first token"
        if not times:
            return
        gaps = self.gaps[index]
        gaps.append(times[0] - self.last_s[index])
        gaps.extend(map(operator.sub, times[1:], times))  # each stamp minus the one before
        self.last_s[index] = times[-1]

    def late_gap(self, index: int) -> None:
        """A gap of ``index`` over the TPOT SLO (a steady decode's: counted as it ends)."""
        self._late[index] += 1
        num_gaps = self.records[index].output_tokens - 1
        if self._late[index] > allowed_late_gaps(num_gaps):
            self._miss(index)

    def finish(self, index: int, now: float) -> None:
        if self.last_s[index] < now and self.first_s[index] is not None:  # flush held text
            self.num_silent[index] -= 1
            gap = now - self.last_s[index]
            self.gaps[index].append(gap)
            self.last_s[index] = now
            if self.slo is not None and gap > self.slo.tpot_s:
                self.late_gap(index)
        self.finish_s[index] = now
        self._requests.pop(index, None)
        first = self.first_s[index]
        if self.slo is None or first is None:
            return
        if first - self.records[index].arrival_s > self.slo.ttft_s:
            self._miss(index)

    def fail(self, index: int, now: float, error: str) -> None:
        if self.errors[index] is None:
            self.errors[index] = error
            self.finish_s[index] = now
        self._miss(index)

    def deadline(self, index: int) -> None:
        """The TTFT SLO elapsed: a request with no first token yet has missed."""
        if self.first_s[index] is None:
            self._miss(index)

    def _miss(self, index: int) -> None:
        if self._missed[index]:
            return
        self._missed[index] = True
        self._num_missed += 1
        if self._num_missed > self._max_missed:
            self.failed = True

    def results(self, unfinished_error: str) -> list[RequestResult]:
        out = []
        for index, record in enumerate(self.records):
            first = self.first_s[index]
            end = self.finish_s[index]
            error = self.errors[index]
            if error is None and end is None:
                error = unfinished_error
            arrival = record.arrival_s
            out.append(
                RequestResult(
                    request_id=record.request_id or str(index),
                    arrival_s=arrival,
                    prompt_tokens=record.prompt_tokens,
                    num_images=record.num_images,
                    output_tokens=record.output_tokens,
                    ttft_s=None if first is None else first - arrival,
                    itl_s=tuple(self.gaps[index]),
                    e2e_s=None if end is None else end - arrival,
                    num_output_tokens=len(self.gaps[index])
                    + (first is not None)
                    + self.num_silent[index],
                    error=error,
                    stage_s=self.stage_s[index] or None,
                    path=tuple(self.paths[index]),
                )
            )
        return out
