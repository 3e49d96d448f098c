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
    compose,
    counts_bound,
    role_work_s,
    stage_work,
    work_budgets,
)
from epd_engine.profiler.budgets import derive_budgets
from epd_engine.profiler.candidates import Candidate
from epd_engine.profiler.cost_model import FittedCostModel
from epd_engine.profiler.gc_pause import gc_paused
from epd_engine.profiler.rate_grid import RateGrid
from epd_engine.profiler.simulator import Simulator
from epd_engine.profiler.tensor_parallel import sized
from epd_engine.slo.attainment import passes
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
        self._sized: dict[int, FittedCostModel] = {1: cost}
        self._budgets: dict[tuple[Role, int], Budgets | None] = {}
        self._work: dict[tuple[Method, tuple[int, ...]], StageWork | None] = {}
        # methods and sizes that agree on what stage_work reads share its result
        self._work_by: dict[tuple[int, int, int], StageWork] = {}
        # each pool's work per request, in ``method.roles`` order (``bounds.role_work_s``)
        self._role_work: dict[tuple[Method, tuple[int, ...]], tuple[float, ...] | None] = {}
        self._runs: dict[tuple[Candidate, float], list[RequestResult]] = {}
        self.num_simulations = 0

    # ---- static analysis ------------------------------------------------------------------
    def cost_at(self, size: int) -> FittedCostModel:
        """The cost of an instance of ``size`` ranks (``tensor_parallel.sized``)."""
        if size not in self._sized:
            self._sized[size] = sized(self.cost, size)
        return self._sized[size]

    def budgets_at(self, role: Role, size: int = 1) -> Budgets | None:
        if (role, size) not in self._budgets:
            self._budgets[(role, size)] = derive_budgets(self.cost_at(size), role, self.slo)
        return self._budgets[(role, size)]

    def work(self, method: Method, sizes: tuple[int, ...] = ()) -> StageWork | None:
        """Per-stage work under ``method`` with its pools at ``sizes`` (``Candidate.sizes``):
        each stage at the cost and budgets of the pool that runs it."""
        key = (method, sizes)
        if key not in self._work:
            size_of = dict(zip(method.roles, sizes, strict=True)) if sizes else {}
            stage_size = {s: size_of.get(method.role_for(s), 1) for s in Stage}
            by_stage = {s: self.budgets_at(method.role_for(s), stage_size[s]) for s in Stage}
            known = {s: b for s, b in by_stage.items() if b is not None}
            self._work[key] = None
            if len(known) == len(by_stage):
                parts = {s: self._stage_work(known, stage_size[s]) for s in Stage}
                self._work[key] = compose(parts)
        return self._work[key]

    def _stage_work(self, budgets: dict[Stage, Budgets], size: int) -> StageWork:
        key = (*work_budgets(budgets), size)
        if key not in self._work_by:
            self._work_by[key] = stage_work(self.records, self.cost_at(size), budgets)
        return self._work_by[key]

    def bound(self, candidate: Candidate) -> float:
        """``bounds.goodput_bound``, its per-method part computed once for every ratio."""
        method = candidate.method
        key = (method, candidate.sizes)
        if key not in self._role_work:
            work = self.work(*key)
            self._role_work[key] = None
            if work is not None:
                args = (self.slo, len(self.records), self.cost.overlap)
                if (by_role := role_work_s(method, work, *args)) is not None:
                    self._role_work[key] = tuple(by_role[r] for r in method.roles)
        work_s = self._role_work[key]
        return 0.0 if work_s is None else counts_bound(candidate.counts, work_s)

    # ---- simulation -----------------------------------------------------------------------
    def plan(self, candidate: Candidate) -> Plan:
        budgets = {
            r: b
            for r in candidate.method.roles
            if (b := self.budgets_at(r, candidate.size_of(r))) is not None
        }
        return Plan(
            method=candidate.method,
            pools=candidate.pools,
            budgets=budgets,
            tensor_parallel=candidate.tensor_parallel,
        )

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
        with gc_paused():  # a summary of ~1.5 M gaps allocates as much as the run
            summary = summarize(self.run(candidate, rate_rps), self.slo)
        share = summary.attainment or 0.0  # computed once: each request's gaps are sorted
        passed = share >= self.slo.attainment - 1e-12
        return RatePoint(rate_rps, share, passed, summary)

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
