"""``sizing.fewest_instances``: the fewest instances whose best plan covers a rate, found by
galloping from the current size. The search is a function of the count here (goodput rising
with it, as the module assumes), so every count and start can be checked against a scan."""

from __future__ import annotations

import itertools

import pytest

from epd_engine.config import Method, Role
from epd_engine.contracts.plan import Plan, Prediction
from epd_engine.profiler.candidates import Candidate
from epd_engine.profiler.evaluate import Evaluation
from epd_engine.profiler.search import SearchResult
from epd_operator.planning.sizing import fewest_instances, start_size

# goodput by instance count: rising, with plateaus (a method's ratio that gains nothing)
GOODPUT = [0.0, 0.0, 9.0, 15.0, 15.0, 26.0, 31.0, 40.0, 40.0, 40.0, 52.0, 61.0, 70.0]


class CountingSearch:
    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, n: int) -> SearchResult:
        self.sizes.append(n)
        rps = GOODPUT[n]
        best = None
        if rps > 0:
            best = Evaluation(Candidate(Method.EPD, (n,)), rps, rps, status="searched")
        return SearchResult("fake", best, [best] if best else [], 1, 0, 1, 0.0)


def scan(low: int, high: int, target: float) -> tuple[int, bool]:
    for n in range(low, high + 1):
        if GOODPUT[n] >= target:
            return n, True
    return high, False


@pytest.mark.parametrize("low,high", [(1, 12), (3, 9), (5, 5)])
def test_every_start_finds_what_a_scan_finds(low: int, high: int) -> None:
    targets = sorted({*GOODPUT, *(g + 0.5 for g in GOODPUT), 100.0})
    for target, near in itertools.product(targets, [None, *range(0, 14)]):
        search = CountingSearch()
        sized = fewest_instances(search, low, high, target, near)
        assert (sized.num_instances, sized.covers) == scan(low, high, target), (target, near)
        assert sized.num_searches == len(search.sizes) == len(set(search.sizes))
        assert all(low <= n <= high for n in search.sizes)


@pytest.mark.parametrize("near,target,expected", [(6, 30.0, 6), (6, 35.0, 7), (6, 20.0, 5)])
def test_a_size_one_away_from_the_current_costs_two_or_three_searches(
    near: int, target: float, expected: int
) -> None:
    """The defect: the bisection began at ``high`` every pass, the slowest search of all
    (9-11 s of a 24-34 s pass at 32 GPUs), though the size moves by one or two instances."""
    search = CountingSearch()
    sized = fewest_instances(search, 1, 12, target, near)
    assert sized.num_instances == expected
    assert 12 not in search.sizes
    assert len(search.sizes) <= 3


def test_an_empty_range_is_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        fewest_instances(CountingSearch(), 4, 3, 1.0)


def test_the_search_starts_where_the_current_plan_scaled_to_the_target_lands() -> None:
    ten = Plan(method=Method.EPD, pools={Role.EPD: 10}, reason="now")
    assert start_size(None, 5.0) is None
    assert start_size(ten, 5.0) == 10  # no prediction: its own size
    predicted = ten.model_copy(
        update={"predicted": Prediction(goodput_rps=4.0, ttft_p90_s=0.1, tpot_p90_s=0.01)}
    )
    assert start_size(predicted, 6.0) == 15  # 10 x 6 / 4
    assert start_size(predicted, 3.9) == 10
    assert start_size(predicted, 0.01) == 1
