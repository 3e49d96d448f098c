"""Plan search: exhaustive over every method and ratio (pruned by a bound) and HydraInfer's
heuristic, both scored by simulated goodput on the trace; a ranked table; the chosen Plan.

Exhaustive, best-first: candidates are visited in order of their goodput bound
(``bounds.goodput_bound``). The first is searched fully; each later one is first checked at
the best goodput so far x (1 + tolerance) with an early-stopping simulation: failing there
proves it cannot win (assuming attainment falls as rate grows), passing starts a full search
from that rate. Once a bound is below that threshold, it and every later candidate are pruned.
A candidate within the tolerance of the best can be missed; that is the price of the speed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from epd_engine.config import SLO, Method
from epd_engine.plan import Plan
from epd_engine.profiler.bounds import pool_work_s
from epd_engine.profiler.candidates import (
    ALL_METHODS,
    Candidate,
    enumerate_candidates,
    proportional_split,
)
from epd_engine.profiler.cost_model import FittedCostModel
from epd_engine.profiler.evaluate import Evaluation, Evaluator, prediction
from epd_engine.profiler.workers import CheckPool
from epd_engine.trace import TraceRecord, mean_rate_rps, trace_ref


@dataclass
class SearchResult:
    strategy: str
    best: Evaluation | None
    evaluations: list[Evaluation]  # every candidate considered, ranked best first
    num_candidates: int
    num_pruned: int
    num_simulations: int
    elapsed_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    def ranked(self, include_pruned: bool = False) -> list[Evaluation]:
        rows = [e for e in self.evaluations if include_pruned or e.status != "pruned"]
        return sorted(rows, key=lambda e: (e.rank_key, e.candidate))


def _start_rps(evaluator: Evaluator, bound_rps: float) -> float:
    if bound_rps != float("inf"):
        return max(1e-3, bound_rps / 2)
    return max(1e-3, mean_rate_rps(evaluator.records) or 1.0)


def _max_rps(bound_rps: float) -> float:
    return bound_rps if bound_rps != float("inf") else 1e6


def exhaustive_search(
    evaluator: Evaluator,
    num_gpus: int,
    methods: Sequence[Method] = ALL_METHODS,
    show_progress: bool = True,
    num_workers: int = 1,
) -> SearchResult:
    """Best-first over all candidates; ``num_workers`` > 1 checks candidates in parallel."""
    started = time.perf_counter()
    candidates = enumerate_candidates(num_gpus, methods)
    bounds = {c: evaluator.bound(c) for c in candidates}
    order = sorted(candidates, key=lambda c: (-bounds[c], c))
    best: Evaluation | None = None
    evaluations: list[Evaluation] = []
    worker_sims = 0
    tolerance = 1 + evaluator.rel_tolerance
    bar = tqdm(total=len(order), desc=f"plans for {num_gpus} GPUs", disable=not show_progress)

    def best_rps() -> float:
        return best.goodput_rps if best is not None and best.goodput_rps else 0.0

    def settle(found: Evaluation) -> None:
        nonlocal best
        evaluations.append(found)
        if found.goodput_rps is not None and found.goodput_rps > best_rps():
            best = found
        bar.update(1)
        bar.set_postfix(best=f"{best_rps():.3g} rps", sims=evaluator.num_simulations + worker_sims)

    position = 0
    # The first live candidate is searched from scratch (no threshold to test against yet).
    while position < len(order) and best is None:
        candidate = order[position]
        bound = bounds[candidate]
        if bound <= 0:
            break
        settle(evaluator.searched(candidate, _max_rps(bound), _start_rps(evaluator, bound)))
        position += 1
    with CheckPool(evaluator, num_workers) as pool:
        in_flight: list[Future[tuple[Evaluation, int]]] = []
        while True:
            while position < len(order) and len(in_flight) < pool.capacity:
                candidate = order[position]
                bound = bounds[candidate]
                if bound <= 0 or bound <= best_rps() * tolerance:
                    break  # sorted by bound: no later candidate can win either
                in_flight.append(pool.submit(candidate, best_rps() * tolerance, _max_rps(bound)))
                position += 1
            if not in_flight:
                break
            done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
            for future in done:
                in_flight.remove(future)
                found, num_sims = future.result()
                worker_sims += num_sims if pool.capacity > 1 else 0
                settle(found)
    evaluations += [Evaluation(c, bounds[c]) for c in order[position:]]
    bar.update(len(order) - position)
    bar.close()
    pruned = sum(e.status == "pruned" for e in evaluations)
    result = SearchResult(
        "exhaustive",
        best,
        evaluations,
        len(candidates),
        pruned,
        evaluator.num_simulations + worker_sims,
        time.perf_counter() - started,
    )
    result.evaluations = result.ranked(include_pruned=True)
    return result


def heuristic_candidates(evaluator: Evaluator, num_gpus: int) -> list[Candidate]:
    """HydraInfer: per method, instances in proportion to each pool's work per request."""
    out = []
    for method in ALL_METHODS:
        work = evaluator.work(method)
        if work is None:
            continue
        weights = [pool_work_s(method, r, work, evaluator.cost.overlap) for r in method.roles]
        counts = proportional_split(num_gpus, weights)
        if counts is not None:
            out.append(Candidate(method, counts))
    return out


def heuristic_search(
    evaluator: Evaluator, num_gpus: int, show_progress: bool = True
) -> SearchResult:
    """Partition by work, then compare the methods by replaying the trace (full goodput each)."""
    started = time.perf_counter()
    sims_before = evaluator.num_simulations
    candidates = heuristic_candidates(evaluator, num_gpus)
    evaluations = []
    for candidate in tqdm(candidates, desc="heuristic", disable=not show_progress):
        bound = evaluator.bound(candidate)
        if bound <= 0:
            evaluations.append(Evaluation(candidate, bound, goodput_rps=0.0, status="searched"))
            continue
        start = _start_rps(evaluator, bound)
        evaluations.append(evaluator.searched(candidate, _max_rps(bound), start))
    ranked = sorted(evaluations, key=lambda e: -(e.goodput_rps or 0.0))
    best = ranked[0] if ranked and (ranked[0].goodput_rps or 0) > 0 else None
    return SearchResult(
        "heuristic",
        best,
        ranked,
        len(candidates),
        0,
        evaluator.num_simulations - sims_before,
        time.perf_counter() - started,
    )


def to_plan(
    evaluator: Evaluator,
    evaluation: Evaluation,
    reason: str,
    window: str = "",
) -> Plan:
    base = evaluator.plan(evaluation.candidate)
    return base.model_copy(
        update={
            "predicted": prediction(evaluation),
            "reason": reason,
            "trace": trace_ref(evaluator.records, window),
        }
    )


def plan_from_search(
    evaluator: Evaluator,
    exhaustive: SearchResult,
    heuristic: SearchResult | None,
    slo: SLO,
    window: str = "",
) -> Plan | None:
    best = exhaustive.best
    if best is None:
        return None
    gap = ""
    if heuristic is not None and heuristic.best is not None and best.goodput_rps:
        lost = 1 - (heuristic.best.goodput_rps or 0.0) / best.goodput_rps
        gap = f"; heuristic pick {heuristic.best.candidate.describe()} is {lost:.0%} below"
    reason = (
        f"highest simulated goodput of {exhaustive.num_candidates} plans for "
        f"{best.candidate.num_instances} GPUs at TTFT<={slo.ttft_s:g}s, "
        f"TPOT<={slo.tpot_s:g}s ({exhaustive.num_pruned} pruned by bound){gap}"
    )
    return to_plan(evaluator, best, reason, window)


def table_rows(result: SearchResult, limit: int | None = 20) -> list[dict[str, Any]]:
    """The ranked table (JSON-friendly): evaluated candidates, best first."""
    rows = []
    for rank, e in enumerate(result.ranked()[:limit], start=1):
        summary = e.point.summary if e.point else None
        rows.append(
            {
                "rank": rank,
                "plan": e.candidate.describe(),
                "method": e.candidate.method.value,
                "pools": {r.value: n for r, n in e.candidate.pools.items()},
                "goodput_rps": e.goodput_rps,
                "below_rps": e.below_rps,
                "bound_rps": None if e.bound_rps == float("inf") else e.bound_rps,
                "ttft_p90_s": summary.ttft.p90_s if summary else None,
                "tpot_p90_s": summary.tpot_p90.p90_s if summary else None,
                "status": e.status,
            }
        )
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    header = f"{'#':>3}  {'plan':<22} {'goodput':>12} {'bound':>9} {'p90 TTFT':>9} {'p90 TPOT':>9}"
    lines = [header, "-" * len(header)]
    for row in rows:
        if row["goodput_rps"] is not None:
            goodput = f"{row['goodput_rps']:.3f} rps"
        else:
            goodput = f"< {row['below_rps']:.3f}"
        bound = f"{row['bound_rps']:.3f}" if row["bound_rps"] is not None else "inf"
        ttft = f"{row['ttft_p90_s']:.3f}s" if row["ttft_p90_s"] is not None else "-"
        tpot = f"{row['tpot_p90_s'] * 1e3:.1f}ms" if row["tpot_p90_s"] is not None else "-"
        lines.append(
            f"{row['rank']:>3}  {row['plan']:<22} {goodput:>12} {bound:>9} {ttft:>9} {tpot:>9}"
        )
    return "\n".join(lines)


def search_plans(
    records: Sequence[TraceRecord],
    cost: FittedCostModel,
    slo: SLO,
    num_gpus: int,
    *,
    methods: Sequence[Method] = ALL_METHODS,
    with_heuristic: bool = True,
    show_progress: bool = True,
    rel_tolerance: float = 0.05,
    num_workers: int = 1,
) -> tuple[Evaluator, SearchResult, SearchResult | None]:
    evaluator = Evaluator(records, cost, slo, rel_tolerance)
    exhaustive = exhaustive_search(evaluator, num_gpus, methods, show_progress, num_workers)
    heuristic = heuristic_search(evaluator, num_gpus, show_progress) if with_heuristic else None
    return evaluator, exhaustive, heuristic
