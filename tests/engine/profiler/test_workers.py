"""Parallel plan search: the pool stops simulations whose answer no longer matters."""

from __future__ import annotations

import signal
import time
from types import FrameType

import pytest

from epd_engine.config import SLO, Method
from epd_engine.profiler.candidates import Candidate
from epd_engine.profiler.evaluate import Evaluator
from epd_engine.profiler.search import exhaustive_search
from epd_engine.slo.goodput import RatePoint

from .factories import make_trace, toy_cost_model


def test_the_search_returns_without_waiting_for_a_moot_simulation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two workers probe the bound and one step under it at once; the bound passes, which
    settles the search. The probe under it (made endless here, a stand-in for a long
    simulation: the simulator itself is replaced) must be stopped, not waited for: the
    search used to join its worker before returning."""
    evaluator = Evaluator(make_trace(num=20), toy_cost_model(), SLO(ttft_s=10.0, tpot_s=1.0))
    (candidate,) = [Candidate(Method.EPD, (1,))]
    top = evaluator.grid.floor_index(evaluator.bound(candidate))

    def point(self: Evaluator, probed: Candidate, rate_rps: float) -> RatePoint:
        if rate_rps < evaluator.grid.rate(top):
            time.sleep(45)  # in a worker process: longer than the alarm below
        return RatePoint(rate_rps, 1.0, True)

    def too_long(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError("the search waited for a simulation whose result was moot")

    monkeypatch.setattr(Evaluator, "point", point)
    previous = signal.signal(signal.SIGALRM, too_long)
    signal.alarm(20)
    try:
        result = exhaustive_search(
            evaluator, 1, methods=[Method.EPD], show_progress=False, num_workers=2
        )
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert result.best is not None and result.best.candidate == candidate
    assert result.best.goodput_rps == evaluator.grid.rate(top)
