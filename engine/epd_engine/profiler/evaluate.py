"""Goodput of one candidate plan on a trace, by simulation (what the plan search calls).

Rates are applied with ``bench.arrivals.at_rate`` (the trace's own inter-arrival pattern,
rescaled) and goodput is found with ``bench.goodput.find_goodput``: the same code
``epdctl bench`` uses against a live server. Simulations stop as soon as the SLO is
certainly lost, so checking that a plan does *not* reach a rate is cheap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epd_engine.config import SLO, Method, Role, Stage
from epd_engine.contracts.plan import Budgets, Plan, Prediction
from epd_engine.contracts.trace import TraceRecord
from epd_engine.profiler.bounds import (
    StageWork,
    capacity_bound,
    role_work_s,
    stage_work,
    work_budgets,
)
from epd_engine.profiler.budgets import derive_budgets
from epd_engine.profiler.candidates import Candidate
from epd_engine.profiler.cost_model import FittedCostModel
from epd_engine.profiler.rate_grid import RateGrid
from epd_engine.profiler.simulator import Simulator
from epd_engine.slo.attainment import attainment, passes
from epd_engine.slo.goodput import GoodputResult, RatePoint, find_goodput
from epd_engine.slo.outcomes import RequestResult, summarize
from epd_engine.workload.arrivals import at_rate


@dataclass(frozen=True)
class Evaluation:
    """What the search knows about one candidate."""

    candidate: Candidate
    bound_rps: float
    goodput_rps: float | None = None  # exact (within tolerance) when searched
    below_rps: float | None = None  # known only to fail at this rate
    point: RatePoint | None = None  # the passing point at ``goodput_rps``
    status: str = "pruned"  # searched | below | pruned

    @property
    def rank_key(self) -> tuple[int, float, float]:
        """Best first: searched by goodput, then known-below by their failing rate, then pruned
        by bound (a "below" row may be anywhere under its rate, so never above a known one)."""
        if self.goodput_rps is not None:
            return (0, -self.goodput_rps, -self.bound_rps)
        if self.below_rps is not None:
            return (1, -self.below_rps, -self.bound_rps)
        return (2, -self.bound_rps, 0.0)


class Evaluator:
    def __init__(
        self,
        records: Sequence[TraceRecord],
        cost: FittedCostModel,
        slo: SLO,
        rel_tolerance: float = 0.05,
        instances_per_node: int | None = None,
        grouped: bool = False,
    ) -> None:
        """``instances_per_node``: how many instances share a node; migrations between nodes
        are charged ``cost.remote_migration`` (``profiler/placement.py``). None: one node.
        ``grouped``: one pod per slice of each plan (``Simulator``'s ``grouped``)."""
        if not records:
            raise ValueError("the trace is empty: nothing to plan for")
        self.records = list(records)
        self.cost = cost
        self.slo = slo
        self.rel_tolerance = rel_tolerance
        self.instances_per_node = instances_per_node
        self.grouped = grouped
        self.grid = RateGrid(step=rel_tolerance)
        self.budgets: dict[Role, Budgets | None] = {
            role: derive_budgets(cost, role, slo) for role in Role
        }
        self._work: dict[Method, StageWork | None] = {}
        self._work_by_budgets: dict[tuple[int, int], StageWork] = {}  # methods that agree
        self._role_work: dict[Method, dict[Role, float] | None] = {}
        self._runs: dict[tuple[Candidate, float], list[RequestResult]] = {}
        self.num_simulations = 0

    # ---- static analysis ------------------------------------------------------------------
    def work(self, method: Method) -> StageWork | None:
        if method not in self._work:
            by_stage = {stage: self.budgets[method.role_for(stage)] for stage in Stage}
            known = {s: b for s, b in by_stage.items() if b is not None}
            if len(known) < len(by_stage):
                self._work[method] = None
            else:
                key = work_budgets(known)
                if key not in self._work_by_budgets:
                    work = stage_work(self.records, self.cost, known)
                    self._work_by_budgets[key] = work
                self._work[method] = self._work_by_budgets[key]
        return self._work[method]

    def bound(self, candidate: Candidate) -> float:
        """``bounds.goodput_bound``, its per-method part computed once for every ratio."""
        method = candidate.method
        if method not in self._role_work:
            work = self.work(method)
            self._role_work[method] = None
            if work is not None:
                args = (self.slo, len(self.records), self.cost.overlap)
                self._role_work[method] = role_work_s(method, work, *args)
        return capacity_bound(candidate.pools, self._role_work[method])

    # ---- simulation -----------------------------------------------------------------------
    def plan(self, candidate: Candidate) -> Plan:
        budgets = {r: b for r in candidate.method.roles if (b := self.budgets[r]) is not None}
        return Plan(method=candidate.method, pools=candidate.pools, budgets=budgets)

    def run(self, candidate: Candidate, rate_rps: float) -> list[RequestResult]:
        key = (candidate, round(rate_rps, 9))
        if key not in self._runs:
            simulator = Simulator(
                self.plan(candidate),
                self.cost,
                self.slo,
                instances_per_node=self.instances_per_node,
                grouped=self.grouped,
            )
            result = simulator.run(at_rate(self.records, rate_rps), stop_on_failure=True)
            self.num_simulations += 1
            self._runs[key] = result.results
        return self._runs[key]

    def point(self, candidate: Candidate, rate_rps: float) -> RatePoint:
        """One simulated rate: pass / fail, attainment and the summary (what ``find_goodput``
        measures, here for one rate the grid search picked)."""
        results = self.run(candidate, rate_rps)
        share = attainment(results, self.slo)
        passed = share >= self.slo.attainment - 1e-12
        return RatePoint(rate_rps, share, passed, summarize(results, self.slo))

    def reaches(self, candidate: Candidate, rate_rps: float) -> bool:
        return passes(self.run(candidate, rate_rps), self.slo)

    def goodput(self, candidate: Candidate, start_rps: float, max_rps: float) -> GoodputResult:
        return find_goodput(
            lambda rate: self.run(candidate, rate),
            self.slo,
            start_rps=start_rps,
            min_rps=min(start_rps, max(1e-3, start_rps / 256)),
            max_rps=max(start_rps, max_rps),
            rel_tolerance=self.rel_tolerance,
        )

    def searched(self, candidate: Candidate, bound_rps: float, start_rps: float) -> Evaluation:
        result = self.goodput(candidate, start_rps, bound_rps)
        point = next(
            (p for p in result.points if p.rate_rps == result.goodput_rps and p.passed), None
        )
        return Evaluation(candidate, bound_rps, result.goodput_rps, point=point, status="searched")


def prediction(evaluation: Evaluation) -> Prediction:
    summary = evaluation.point.summary if evaluation.point else None
    return Prediction(
        goodput_rps=evaluation.goodput_rps or 0.0,
        ttft_p90_s=summary.ttft.p90_s if summary else 0.0,
        tpot_p90_s=summary.tpot_p90.p90_s if summary else 0.0,
    )
