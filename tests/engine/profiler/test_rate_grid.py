"""The rate grid and one candidate's bracket: the exact search's building blocks."""

from __future__ import annotations

from epd_engine.profiler.rate_grid import RateGrid
from epd_engine.slo.goodput import RatePoint


def _search(grid: RateGrid, goodput_index: int, bound_rps: float, parallel: int = 1) -> list[int]:
    """Drive a bracket against a plan that passes exactly up to ``goodput_index``."""
    bracket = grid.bracket(bound_rps)
    probed = []
    while not bracket.settled:
        batch = []
        while (index := bracket.next_probe(parallel)) is not None:
            bracket.in_flight.add(index)
            batch.append(index)
        assert batch, "an unsettled bracket must propose a probe"
        for index in batch:
            probed.append(index)
            bracket.record(index, RatePoint(grid.rate(index), 1.0, index <= goodput_index))
    assert bracket.exact
    assert bracket.passed == (goodput_index if goodput_index >= bracket.bottom else None)
    return probed


def test_floor_index_is_exact_at_grid_rates_despite_float_error() -> None:
    grid = RateGrid(0.05)
    for index in range(-80, 200, 7):
        assert grid.floor_index(grid.rate(index)) == index
        assert grid.floor_index(grid.rate(index) * 0.999) == index - 1


def test_bracket_finds_every_goodput_index_under_the_bound() -> None:
    grid = RateGrid(0.05)
    top = grid.floor_index(100.0)
    for goodput in [top, top - 1, top - 14, top - 40, top - 200]:
        serial = _search(grid, goodput, 100.0)
        parallel = _search(grid, goodput, 100.0, parallel=2)
        assert len(serial) <= 16
        assert len(set(parallel)) == len(parallel)  # never the same rate twice


def test_a_tight_bound_settles_in_two_simulations() -> None:
    """Goodput one index under the bound (issue 19's mixed traces): the search probes the
    bound, then one under it, instead of bisecting up from half the bound (5 simulations)."""
    grid = RateGrid(0.05)
    top = grid.floor_index(43.8)
    assert _search(grid, top - 1, 43.8) == [top, top - 1]
    assert _search(grid, top - 1, 43.8, parallel=2) == [top, top - 1]
    assert _search(grid, top, 43.8) == [top]


def test_a_floor_settles_a_candidate_with_one_failing_simulation() -> None:
    grid = RateGrid(0.05)
    bracket = grid.bracket(100.0)
    bracket.floor = grid.floor_index(60.0)
    assert bracket.next_probe(2) == bracket.floor
    bracket.in_flight.add(bracket.floor)
    assert bracket.next_probe(2) is None  # nothing else matters until the floor is known
    bracket.record(bracket.floor, RatePoint(60.0, 0.5, False))
    assert bracket.settled and bracket.below_floor and not bracket.exact


def test_a_floor_above_the_bound_needs_no_simulation() -> None:
    grid = RateGrid(0.05)
    bracket = grid.bracket(50.0)
    bracket.floor = grid.floor_index(60.0)
    assert bracket.settled and bracket.next_probe(1) is None
