"""Candidate checks in worker processes (the exhaustive search's parallel mode).

Workers are forked after the evaluator is built, so they inherit the trace and cost model
instead of receiving them pickled; each check returns its ``Evaluation`` and how many
simulations it ran. With one worker everything runs in-process.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import Future, ProcessPoolExecutor
from types import TracebackType

from epd_engine.profiler.candidates import Candidate
from epd_engine.profiler.evaluate import Evaluation, Evaluator

_EVALUATOR: Evaluator | None = None  # set in the parent right before forking


def check(candidate: Candidate, threshold_rps: float, bound_rps: float) -> tuple[Evaluation, int]:
    """Does ``candidate`` reach ``threshold_rps``? If so, its full goodput search."""
    evaluator = _EVALUATOR
    assert evaluator is not None, "check() runs only in a CheckPool"
    before = evaluator.num_simulations
    if evaluator.reaches(candidate, threshold_rps):
        found = evaluator.searched(candidate, bound_rps, threshold_rps)
    else:
        found = Evaluation(candidate, bound_rps, below_rps=threshold_rps, status="below")
    return found, evaluator.num_simulations - before


class CheckPool:
    def __init__(self, evaluator: Evaluator, num_workers: int) -> None:
        self.evaluator = evaluator
        self.num_workers = max(1, num_workers)
        self._executor: ProcessPoolExecutor | None = None

    def __enter__(self) -> CheckPool:
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
            self._executor.shutdown(cancel_futures=True)
        _EVALUATOR = None

    @property
    def capacity(self) -> int:
        return self.num_workers if self._executor is not None else 1

    def submit(
        self, candidate: Candidate, threshold_rps: float, bound_rps: float
    ) -> Future[tuple[Evaluation, int]]:
        if self._executor is not None:
            return self._executor.submit(check, candidate, threshold_rps, bound_rps)
        future: Future[tuple[Evaluation, int]] = Future()
        future.set_result(check(candidate, threshold_rps, bound_rps))
        return future
