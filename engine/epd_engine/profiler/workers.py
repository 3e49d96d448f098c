"""Simulations in worker processes: the plan search's parallel mode.

The unit of work is one simulation (a candidate at one grid rate), so both workers stay busy
from the first candidate on: two rates of one bracket, or one candidate's search beside the
next one's check (``search.exhaustive_search``). Workers are forked after the evaluator is
built, so they inherit the trace and cost model instead of receiving them pickled, and are
real processes: the simulator is pure Python and would hold the GIL in threads. With one
worker everything runs in-process.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import Future, ProcessPoolExecutor
from types import TracebackType

from epd_engine.profiler.candidates import Candidate
from epd_engine.profiler.evaluate import Evaluation, Evaluator
from epd_engine.slo.goodput import RatePoint

_EVALUATOR: Evaluator | None = None  # set in the parent right before forking


def simulate_point(candidate: Candidate, rate_rps: float) -> RatePoint:
    evaluator = _EVALUATOR
    assert evaluator is not None, "simulate_point() runs only in a pool"
    return evaluator.point(candidate, rate_rps)


def check(candidate: Candidate, threshold_rps: float, bound_rps: float) -> tuple[Evaluation, int]:
    """Does ``candidate`` reach ``threshold_rps``? If so, its full goodput search.

    (The search before the rate grid, kept for ``bench-plan``'s before/after comparison.)"""
    evaluator = _EVALUATOR
    assert evaluator is not None, "check() runs only in a pool"
    before = evaluator.num_simulations
    if evaluator.reaches(candidate, threshold_rps):
        found = evaluator.searched(candidate, bound_rps, threshold_rps)
    else:
        found = Evaluation(candidate, bound_rps, below_rps=threshold_rps, status="below")
    return found, evaluator.num_simulations - before


class SimPool:
    def __init__(self, evaluator: Evaluator, num_workers: int) -> None:
        self.evaluator = evaluator
        self.num_workers = max(1, num_workers)
        self._executor: ProcessPoolExecutor | None = None

    def __enter__(self) -> SimPool:
        global _EVALUATOR
        _EVALUATOR = self.evaluator
        if self.num_workers > 1 and "fork" in multiprocessing.get_all_start_methods():
            context = multiprocessing.get_context("fork")
            self._executor = ProcessPoolExecutor(self.num_workers, mp_context=context)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        global _EVALUATOR
        if self._executor is not None:
            self._stop(self._executor)
        _EVALUATOR = None

    @staticmethod
    def _stop(executor: ProcessPoolExecutor) -> None:
        """Shut down without waiting for simulations still running: the search has its
        answer, so they are moot (a probe beside the one that settled it). Their workers are
        terminated and reaped (their CPU seconds still count in ``RUSAGE_CHILDREN``)."""
        # ProcessPoolExecutor has no public way to stop a running task before Python 3.14.
        workers = list((getattr(executor, "_processes", None) or {}).values())
        executor.shutdown(wait=False, cancel_futures=True)
        for process in workers:
            process.terminate()
        for process in workers:
            process.join()

    @property
    def capacity(self) -> int:
        return self.num_workers if self._executor is not None else 1

    def simulate(self, candidate: Candidate, rate_rps: float) -> Future[RatePoint]:
        if self._executor is not None:
            return self._executor.submit(simulate_point, candidate, rate_rps)
        future: Future[RatePoint] = Future()
        future.set_result(simulate_point(candidate, rate_rps))
        return future

    def check(
        self, candidate: Candidate, threshold_rps: float, bound_rps: float
    ) -> Future[tuple[Evaluation, int]]:
        if self._executor is not None:
            return self._executor.submit(check, candidate, threshold_rps, bound_rps)
        future: Future[tuple[Evaluation, int]] = Future()
        future.set_result(check(candidate, threshold_rps, bound_rps))
        return future
