"""Plan search: exhaustive over every method and ratio (pruned by a bound) and HydraInfer's
heuristic, both scored by simulated goodput on the trace; a ranked table; the chosen Plan.

Exhaustive, best-first on a shared rate grid (``best_first``, ``rate_grid``): candidates are
visited in order of their goodput bound (``bounds.goodput_bound``); each is first simulated
at its floor, the lowest grid rate at which it would beat the best so far, with an
early-stopping simulation: failing there proves it cannot win; passing starts its search
above the floor. The first one (no floor yet) is probed down from its bound, usually tight.
Once a bound is under the floor, it and every later candidate are pruned.
The chosen plan is the one simulating every candidate would choose (docs/planning.md).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from epd_engine.config import SLO, Method
from epd_engine.contracts.plan import Plan
from epd_engine.contracts.trace import TraceRecord, mean_rate_rps, trace_ref
from epd_engine.profiler.best_first import BestFirst, grid_goodput
from epd_engine.profiler.bounds import pool_work_s
from epd_engine.profiler.candidates import (
    ALL_METHODS,
    Candidate,
    enumerate_candidates,
    order_key,
    proportional_split,
)
from epd_engine.profiler.cost_model import FittedCostModel
from epd_engine.profiler.evaluate import Evaluation, Evaluator, prediction
from epd_engine.profiler.rate_grid import MAX_RPS
from epd_engine.profiler.workers import SimPool
from epd_engine.slo.goodput import RatePoint


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
        return sorted(rows, key=lambda e: (e.rank_key, *order_key(e.candidate)))


def start_rps(evaluator: Evaluator, bound_rps: float) -> float:
    if bound_rps != float("inf"):
        return max(1e-3, bound_rps / 2)
    return max(1e-3, mean_rate_rps(evaluator.records) or 1.0)


def max_rps(bound_rps: float) -> float:
    return bound_rps if bound_rps != float("inf") else MAX_RPS


@dataclass(frozen=True)
class Hint:
    """What the last search on a sliding window chose: searched first, from its goodput, so a
    re-plan whose answer did not move settles in a few simulations. Changes speed only: the
    answer is the same with or without it (ties break by the static order, not the visit)."""

    candidate: Candidate
    goodput_rps: float


def exhaustive_search(
    evaluator: Evaluator,
    num_gpus: int,
    methods: Sequence[Method] = ALL_METHODS,
    show_progress: bool = True,
    num_workers: int = 1,
    hint: Hint | None = None,
    tp_sizes: Sequence[int] = (1,),
) -> SearchResult:
    """Best-first over all candidates on the rate grid; ``num_workers`` > 1 simulates in
    parallel. The answer is the exhaustive one (see ``BestFirst``). ``tp_sizes``: the
    tensor-parallel sizes each pool that runs the language model may take."""
    started = time.perf_counter()
    candidates = enumerate_candidates(num_gpus, methods, tp_sizes)
    search = BestFirst(evaluator, candidates, hint)
    bar = tqdm(total=len(candidates), desc=f"plans for {num_gpus} GPUs", disable=not show_progress)
    with SimPool(evaluator, num_workers) as pool:
        in_flight: dict[Future[RatePoint], tuple[Candidate, int]] = {}
        while True:
            while len(in_flight) < pool.capacity and (job := search.next_job(pool.capacity)):
                candidate, index = job
                in_flight[pool.simulate(candidate, evaluator.grid.rate(index))] = job
            if not in_flight or search.finished:
                break  # moot simulations still running are stopped with the pool
            done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
            for future in done:
                candidate, index = in_flight.pop(future)
                search.record(candidate, index, future.result())
            bar.n = search.num_settled
            bar.set_postfix(best=f"{search.best_rps:.3g} rps", sims=search.num_simulations)
    bar.n = len(candidates)
    bar.close()
    evaluations = search.evaluations()
    result = SearchResult(
        "exhaustive",
        search.best,
        evaluations,
        len(candidates),
        sum(e.status == "pruned" for e in evaluations),
        search.num_simulations,
        time.perf_counter() - started,
        {"grid_step": evaluator.grid.step},
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
        evaluations.append(grid_goodput(evaluator, candidate))
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
        f"{best.candidate.num_gpus} GPUs at TTFT<={slo.ttft_s:g}s, "
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
                "tensor_parallel": {r.value: n for r, n in e.candidate.tensor_parallel.items()},
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
    hint: Hint | None = None,
    instances_per_node: int | None = None,
    tp_sizes: Sequence[int] = (1,),
) -> tuple[Evaluator, SearchResult, SearchResult | None]:
    evaluator = Evaluator(records, cost, slo, rel_tolerance, instances_per_node)
    for size in tp_sizes:
        evaluator.cost_at(size)  # a size the cost model cannot give: refused before searching
    exhaustive = exhaustive_search(
        evaluator, num_gpus, methods, show_progress, num_workers, hint, tp_sizes
    )
    heuristic = heuristic_search(evaluator, num_gpus, show_progress) if with_heuristic else None
    return evaluator, exhaustive, heuristic
