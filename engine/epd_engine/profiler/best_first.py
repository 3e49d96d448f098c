"""The exhaustive plan search's bookkeeping: which simulation to run next, and what it proves.

Candidates are visited best-first by their goodput bound (``bounds.goodput_bound``); their
static *position* in that order breaks ties. Every goodput is a grid index (``rate_grid``),
so a candidate can be chosen only if its index beats the best's, or equals it from an
earlier position. That is one simulation at one rate, the candidate's *floor*: failing
there proves it cannot be chosen; passing starts its search above the floor. A candidate
whose bound is under its floor is pruned without a simulation, and so is every later one.

So the chosen plan is the one that simulating every candidate at every rate would choose
(the same grid, the same tie-break), given that attainment falls as the rate grows. Which
simulations run, and in what order (workers finish out of order; a re-plan's hint goes
first), changes the time taken, never the answer.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from epd_engine.profiler.candidates import Candidate, order_key
from epd_engine.profiler.evaluate import Evaluation, Evaluator
from epd_engine.profiler.rate_grid import MAX_RPS, Bracket
from epd_engine.slo.goodput import RatePoint

if TYPE_CHECKING:
    from epd_engine.profiler.search import Hint


class BestFirst:
    def __init__(
        self, evaluator: Evaluator, candidates: Sequence[Candidate], hint: Hint | None = None
    ) -> None:
        self.evaluator = evaluator
        self.grid = evaluator.grid
        self.bounds = {c: evaluator.bound(c) for c in candidates}
        order = sorted(candidates, key=lambda c: (-self.bounds[c], *order_key(c)))
        self.position = {c: i for i, c in enumerate(order)}
        self.queue = deque(order)
        self.start: dict[Candidate, float] = {}
        if hint is not None and hint.candidate in self.position:
            self.queue.remove(hint.candidate)
            self.queue.appendleft(hint.candidate)
            self.start[hint.candidate] = hint.goodput_rps
        self.active: dict[Candidate, Bracket] = {}
        self.settled: dict[Candidate, Evaluation] = {}
        self.best: Evaluation | None = None
        self._best_key: tuple[int, int] | None = None  # (grid index, -position)
        self.num_simulations = 0

    # ---- what to simulate next ----------------------------------------------------------
    @property
    def best_rps(self) -> float:
        return (self.best.goodput_rps or 0.0) if self.best is not None else 0.0

    @property
    def finished(self) -> bool:
        """Every candidate settled or pruned: simulations still in flight are moot."""
        return not self.queue and not self.active

    @property
    def num_settled(self) -> int:
        return len(self.settled)

    def floor(self, candidate: Candidate) -> int | None:
        """The lowest index at which ``candidate`` would be chosen over the best so far."""
        if self._best_key is None:
            return None
        index, minus_position = self._best_key
        return index + 1 if self.position[candidate] > -minus_position else index

    def next_job(self, max_in_flight: int) -> tuple[Candidate, int] | None:
        for candidate, bracket in self.active.items():  # first finish what is started
            index = bracket.next_probe(max_in_flight)
            if index is not None:
                bracket.in_flight.add(index)
                return candidate, index
        while self.queue:
            candidate = self.queue.popleft()
            bound = self.bounds[candidate]
            bracket = self.grid.bracket(min(max(bound, 1e-9), MAX_RPS), self.start.get(candidate))
            bracket.floor = self.floor(candidate)
            if bound <= 0 or bracket.below_floor:
                # Pruned: no rate meets the SLO, or its bound is under its floor. The queue
                # is in bound order, so every later one is too (the hint, out of order,
                # goes first, before there is a floor).
                if candidate not in self.start:
                    self.queue.clear()
                continue
            self.active[candidate] = bracket
            index = bracket.next_probe(max_in_flight)
            if index is not None:
                bracket.in_flight.add(index)
                return candidate, index
        return None

    # ---- what a simulation proves -------------------------------------------------------
    def record(self, candidate: Candidate, index: int, point: RatePoint) -> None:
        self.num_simulations += 1
        bracket = self.active.get(candidate)
        if bracket is None:
            return  # settled while this simulation ran
        bracket.record(index, point)
        if bracket.settled:  # simulations still in flight for it will be ignored
            del self.active[candidate]
            self._settle(candidate, self._evaluation(candidate, bracket))

    def _evaluation(self, candidate: Candidate, bracket: Bracket) -> Evaluation:
        bound = self.bounds[candidate]
        if bracket.exact:
            passed = bracket.passed
            if passed is None:
                return Evaluation(candidate, bound, 0.0, status="searched")
            return Evaluation(
                candidate,
                bound,
                self.grid.rate(passed),
                point=bracket.points[passed],
                status="searched",
            )
        failed = bracket.failed if bracket.failed is not None else bracket.floor
        assert failed is not None
        return Evaluation(candidate, bound, below_rps=self.grid.rate(failed), status="below")

    def _settle(self, candidate: Candidate, evaluation: Evaluation) -> None:
        self.settled[candidate] = evaluation
        if not evaluation.goodput_rps:
            return
        key = (self.grid.floor_index(evaluation.goodput_rps), -self.position[candidate])
        if self._best_key is None or key > self._best_key:
            self._best_key, self.best = key, evaluation
            for other, bracket in list(self.active.items()):  # a higher floor for the rest
                bracket.floor = self.floor(other)
                if bracket.settled:  # it cannot win any more: its simulations in flight are moot
                    del self.active[other]
                    self._settle(other, self._evaluation(other, bracket))

    def evaluations(self) -> list[Evaluation]:
        """Every candidate: settled ones as found, the rest pruned by their bound."""
        return [self.settled.get(c) or Evaluation(c, self.bounds[c]) for c in self.position]


def grid_goodput(evaluator: Evaluator, candidate: Candidate) -> Evaluation:
    """One candidate's goodput on the grid, searched alone and serially (the heuristic's
    comparison, and the reference the exhaustive search is tested against)."""
    search = BestFirst(evaluator, [candidate])
    while (job := search.next_job(1)) is not None:
        search.record(*job, evaluator.point(job[0], evaluator.grid.rate(job[1])))
    bound = search.bounds[candidate]
    return search.settled.get(candidate) or Evaluation(candidate, bound, 0.0, status="searched")
