"""The figures of ``bench_elastic`` from what it recorded: the client's outcomes and the
loop's status after each pass. Pure functions, so a tiny run can check them."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.elastic_client import Outcome


@dataclass
class PassPoint:
    """The loop's status after one pass."""

    t_s: float  # since the traffic started
    plan: str  # e.g. "EPD 4EPD"
    revision: int
    phase: str
    held: dict[str, int]  # instances per role, every pool that exists (old and new)
    decision: dict[str, Any] | None = None
    pass_s: float = 0.0  # how long the pass took (a re-plan's search included)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def instances(self) -> int:
        return sum(self.held.values())


def attainment(
    outcomes: Sequence[Outcome], ttft_s: float, tpot_s: float, mean: bool = False
) -> float | None:
    """Share within the SLO (``mean``: TPOT as the mean gap, ``Outcome.met``)."""
    if not outcomes:
        return None
    return sum(o.met(ttft_s, tpot_s, mean) for o in outcomes) / len(outcomes)


def gpu_seconds(points: Sequence[PassPoint], end_s: float, gpus_per_instance: int = 1) -> float:
    """The instances held, integrated over time (each point holds until the next)."""
    total = 0.0
    for a, b in itertools.pairwise([*points, None]):
        assert a is not None  # only the last of a pair is the sentinel
        until = end_s if b is None else b.t_s
        total += a.instances * gpus_per_instance * max(0.0, min(until, end_s) - a.t_s)
    return total


def method_of(plan: str) -> str:
    return plan.split(" ", 1)[0]


def size_of(plan: str) -> int:
    """Instances of a plan description ("E+P+D 2E1P1D" -> 4)."""
    digits, total = "", 0
    for ch in plan.split(" ", 1)[1] if " " in plan else "":
        if ch.isdigit():
            digits += ch
        elif digits:
            total, digits = total + int(digits), ""
    return total


def plan_changes(points: Sequence[PassPoint]) -> list[dict[str, Any]]:
    """Each new revision: its kind, when it was decided and when it served (every router
    routed to it: phase Draining or RolloutComplete)."""
    out: list[dict[str, Any]] = []
    for prev, point in itertools.pairwise(points):
        if point.revision != prev.revision:
            before, after = size_of(prev.plan), size_of(point.plan)
            kind = "ratio"
            if method_of(point.plan) != method_of(prev.plan):
                kind = "method switch"
            elif after != before:
                kind = "scale up" if after > before else "scale down"
            why = (point.decision or {}).get("outcome", "")
            out.append(
                {
                    "from": prev.plan,
                    "to": point.plan,
                    "kind": kind,
                    "outcome": why,
                    "decided_s": round(point.t_s, 1),
                    "serving_s": None,
                }
            )
        last = out[-1] if out else None
        serves = point.phase in ("Draining", "RolloutComplete")  # every router routes to it
        if last and last["serving_s"] is None and point.plan == last["to"] and serves:
            last["serving_s"] = round(point.t_s, 1)
            last["decision_to_serving_s"] = round(point.t_s - last["decided_s"], 1)
    return out


def decisions(
    points: Sequence[PassPoint],
    outcomes: Sequence[Outcome],
    ttft_s: float,
    tpot_s: float,
    end_s: float,
) -> list[dict[str, Any]]:
    """Each decision of the loop with the goodput measured after it: requests that arrived
    between it and the next decision and met the SLO, per second (and the rate offered)."""
    seen: list[tuple[float, dict[str, Any]]] = []
    for p in points:
        d = p.decision
        if d and (
            not seen
            or (seen[-1][1].get("time"), seen[-1][1].get("outcome"))
            != (d.get("time"), d.get("outcome"))
        ):
            seen.append((p.t_s, d))
    out = []
    for (t, d), nxt in itertools.zip_longest(seen, seen[1:]):
        until = end_s if nxt is None else nxt[0]
        span = max(until - t, 1e-9)
        inside = [o for o in outcomes if t <= o.t_s < until]
        predicted = d.get("predicted_goodput_rps") or d.get("predictedGoodputRps") or ""
        out.append(
            {
                "t_s": round(t, 1),
                "outcome": d.get("outcome"),
                "plan": d.get("plan"),
                "gpus": d.get("gpus"),
                "rate_seen_rps": d.get("rate_seen_rps") or d.get("rateSeenRps"),
                "forecast_rps": d.get("forecast_rps") or d.get("forecastRps"),
                "predicted_goodput_rps": predicted,
                "window_s": round(span, 1),
                "offered_rps": round(len(inside) / span, 3),
                "measured_goodput_rps": round(sum(o.met(ttft_s, tpot_s) for o in inside) / span, 3),
                "alarm": d.get("alarm", ""),
            }
        )
    return out


def timeline(
    outcomes: Sequence[Outcome],
    points: Sequence[PassPoint],
    ttft_s: float,
    tpot_s: float,
    bin_s: float,
    end_s: float,
) -> list[dict[str, Any]]:
    """Per bin of arrivals: the rate offered, the image share, attainment, instances held."""
    rows = []
    t = 0.0
    while t < end_s:
        inside = [o for o in outcomes if t <= o.t_s < t + bin_s]
        held = next((p for p in reversed(points) if p.t_s <= t + bin_s), None)
        rows.append(
            {
                "t_s": round(t, 1),
                "rate_rps": round(len(inside) / bin_s, 3),
                "image_share": round(sum(o.image for o in inside) / len(inside), 3)
                if inside
                else None,
                "attainment": attainment(inside, ttft_s, tpot_s),
                "failed": sum(bool(o.error) for o in inside),
                "held": dict(held.held) if held else {},
                "plan": held.plan if held else "",
            }
        )
        t += bin_s
    return rows
