"""The plan search before the rate grid (continuous bisection per candidate, one candidate
per worker job): kept callable so ``bench-plan`` measures before and after in one run.

Its answer can differ from ``search.exhaustive_search`` within the tolerance: it checks a
later candidate at best x (1 + tolerance), so one less than that much better is missed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait

from epd_engine.config import Method
from epd_engine.profiler.candidates import ALL_METHODS, enumerate_candidates
from epd_engine.profiler.evaluate import Evaluation, Evaluator
from epd_engine.profiler.search import SearchResult, max_rps, start_rps
from epd_engine.profiler.workers import SimPool


def bisection_search(
    evaluator: Evaluator,
    num_gpus: int,
    methods: Sequence[Method] = ALL_METHODS,
    num_workers: int = 1,
) -> SearchResult:
    started = time.perf_counter()
    candidates = enumerate_candidates(num_gpus, methods)
    bounds = {c: evaluator.bound(c) for c in candidates}
    order = sorted(candidates, key=lambda c: (-bounds[c], c))
    best: Evaluation | None = None
    evaluations: list[Evaluation] = []
    worker_sims = 0
    tolerance = 1 + evaluator.rel_tolerance

    def best_rps() -> float:
        return best.goodput_rps if best is not None and best.goodput_rps else 0.0

    def settle(found: Evaluation) -> None:
        nonlocal best
        evaluations.append(found)
        if found.goodput_rps is not None and found.goodput_rps > best_rps():
            best = found

    position = 0
    while position < len(order) and best is None:  # the first live one from scratch, serially
        candidate = order[position]
        bound = bounds[candidate]
        if bound <= 0:
            break
        settle(evaluator.searched(candidate, max_rps(bound), start_rps(evaluator, bound)))
        position += 1
    with SimPool(evaluator, num_workers) as pool:
        in_flight: list[Future[tuple[Evaluation, int]]] = []
        while True:
            while position < len(order) and len(in_flight) < pool.capacity:
                candidate = order[position]
                bound = bounds[candidate]
                if bound <= 0 or bound <= best_rps() * tolerance:
                    break
                in_flight.append(pool.check(candidate, best_rps() * tolerance, max_rps(bound)))
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
    pruned = sum(e.status == "pruned" for e in evaluations)
    result = SearchResult(
        "bisection",
        best,
        evaluations,
        len(candidates),
        pruned,
        evaluator.num_simulations + worker_sims,
        time.perf_counter() - started,
    )
    result.evaluations = result.ranked(include_pruned=True)
    return result
