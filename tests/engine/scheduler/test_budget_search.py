import pytest

from epd_engine.scheduler.budget_search import BudgetSearchError, search_budget


def test_returns_largest_passing_size_and_only_measured_values() -> None:
    measured: dict[int, float] = {}

    def measure(n: int) -> float:
        measured[n] = 0.001 * n
        return measured[n]

    best = search_budget(measure, limit_s=0.0375, max_size=100)
    assert best == 37
    assert best in measured and measured[best] <= 0.0375
    assert measured.get(38, 1.0) > 0.0375


def test_max_size_passing_is_returned() -> None:
    assert search_budget(lambda n: 0.0, limit_s=1.0, max_size=9) == 9


def test_smallest_batch_over_limit_raises() -> None:
    with pytest.raises(BudgetSearchError, match="batch of 1"):
        search_budget(lambda n: 1.0, limit_s=0.5, max_size=10)
