"""SLO alarms over the last scrape window: what the fast path reacts to (``fast_path``).

Two sources the loop already reads:

- the router's **trace** (every finished request with its TTFT and inter-token gaps), over
  the requests that *finished* in the last ``window_s``: TTFT attainment under the SLO's
  target alarms the stage before the first token whose pool has the longer queue (encode or
  prefill; prefill on a tie), TPOT attainment under the target alarms decode;
- the router's **pool table** (``GET /internal/pools``: every instance's heartbeat, with the
  requests waiting in its scheduler), read each pass: a pool whose waiting requests per
  instance stayed at ``QUEUE_MIN`` or more for the last ``QUEUE_READINGS`` readings and grew
  across them alarms its first stage (a backlog that persists and grows means arrivals
  outrun the pool: the SLO is missed next). One reading is not enough: Poisson arrivals
  make a pool running well below its capacity jump from 0 to 2 waiting per instance
  between two 1-s readings now and then, and an alarm on that adds an instance nobody needs
  (the elastic bench's fast path once added 9 encoders that way, at 100 % attainment).

A trace window with fewer than ``MIN_REQUESTS`` finished requests raises no attainment alarm
(too few to tell a miss from noise). Attainment alarms come first, the worse first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from epd_engine.config import SLO, STAGE_ORDER, Role, Stage
from epd_engine.contracts.trace import TraceRecord

MIN_REQUESTS = 8
QUEUE_MIN = 2.0  # waiting requests per instance before a growing queue alarms
QUEUE_READINGS = 3  # consecutive readings (this one included) the backlog must hold

# Waiting requests per instance of each pool role of the current plan (the router's table).
Queues = Mapping[Role, float]


@dataclass(frozen=True)
class SloAlarm:
    kind: str  # "TTFT", "TPOT" or "queue"
    stage: Stage  # the bottleneck stage
    reason: str  # in words, with the numbers


def finished_in(
    records: Sequence[TraceRecord], span_s: float, window_s: float
) -> list[TraceRecord]:
    """Records of a trace window ``span_s`` long (arrivals rebased to its start) that
    finished in its last ``window_s``."""
    start = span_s - window_s
    return [r for r in records if r.ttft_s is not None and _end(r) >= start]


def _end(r: TraceRecord) -> float:
    return r.arrival_s + (r.e2e_s if r.e2e_s is not None else r.ttft_s or 0.0)


def _first_token_stage(queues: Queues) -> Stage:
    """Encode when the pool running it has more waiting per instance than prefill's."""

    def waiting(stage: Stage) -> float:
        return max((q for role, q in queues.items() if role.runs(stage)), default=0.0)

    return Stage.ENCODE if waiting(Stage.ENCODE) > waiting(Stage.PREFILL) else Stage.PREFILL


def attainment_alarms(
    records: Sequence[TraceRecord], slo: SLO, window_s: float, queues: Queues
) -> list[SloAlarm]:
    """TTFT and TPOT attainment of ``records`` (finished in the last ``window_s``)."""
    if len(records) < MIN_REQUESTS:
        return []
    target = slo.attainment * 100
    over = f"over the last {window_s:.0f} s ({len(records)} requests)"
    ttft = 100 * sum((r.ttft_s or 0.0) <= slo.ttft_s for r in records) / len(records)
    tpot = 100 * sum((r.tpot_p90_s or 0.0) <= slo.tpot_s for r in records) / len(records)
    alarms = []
    if ttft < target:
        stage = _first_token_stage(queues)
        alarms.append(
            (ttft, SloAlarm("TTFT", stage, f"TTFT attainment {ttft:.0f}% < {target:.0f}% {over}"))
        )
    if tpot < target:
        reason = f"TPOT attainment {tpot:.0f}% < {target:.0f}% {over}"
        alarms.append((tpot, SloAlarm("TPOT", Stage.DECODE, reason)))
    return [alarm for _, alarm in sorted(alarms, key=lambda a: a[0])]


def queue_alarms(queues: Queues, earlier: Sequence[Queues]) -> list[SloAlarm]:
    """Pools whose waiting requests per instance stayed at ``QUEUE_MIN`` or more over
    ``earlier`` (the previous passes' readings, oldest first) and now, and grew across them,
    the longest queue first. Fewer than ``QUEUE_READINGS - 1`` earlier readings: none."""
    earlier = list(earlier)[-(QUEUE_READINGS - 1) :]
    if len(earlier) < QUEUE_READINGS - 1:
        return []
    grown = [
        (role, q, earlier[0][role])
        for role, q in queues.items()
        if all(role in r and r[role] >= QUEUE_MIN for r in earlier)
        and q >= QUEUE_MIN
        and q > earlier[0][role]
    ]
    return [
        SloAlarm(
            "queue",
            next(s for s in STAGE_ORDER if role.runs(s)),
            f"{role} queue grew from {first:.1f} to {q:.1f} waiting requests per instance "
            f"over the last {QUEUE_READINGS} readings, never under {QUEUE_MIN:.0f}",
        )
        for role, q, first in sorted(grown, key=lambda g: -g[1])
    ]


def slo_alarms(
    records: Sequence[TraceRecord],
    span_s: float,
    slo: SLO,
    window_s: float,
    queues: Queues,
    earlier: Sequence[Queues],
) -> list[SloAlarm]:
    """Every alarm of this pass: ``records`` a trace window ``span_s`` long (read as the last
    ``2 * window_s``, so that a request that arrived before the scrape window but finished in
    it counts), ``queues`` this pass's pool table and ``earlier`` the previous passes'
    (oldest first)."""
    finished = finished_in(records, span_s, window_s)
    return attainment_alarms(finished, slo, window_s, queues) + queue_alarms(queues, earlier)
