"""Merging single-rate reports into one sweep (``bench_fidelity.py --interleave``)."""

from __future__ import annotations

from typing import Any

import pytest

from epd_engine.bench.sweep_merge import merge_sweeps


def report(rate: float, passed: bool, created: str) -> dict[str, Any]:
    return {
        "kind": "epd-bench",
        "created_at": created,
        "points": [{"rate_rps": rate, "attainment": 1.0 if passed else 0.5, "passed": passed}],
        "goodput_rps": rate if passed else 0.0,
        "lowest_failing_rps": None if passed else rate,
        "summary": {"rate": rate},
        "requests": [{"rate": rate}],
        "requests_by_rate": {f"{rate}": [{"request_id": f"r{rate}"}]},
    }


def test_points_requests_and_goodput_are_a_sweeps() -> None:
    merged = merge_sweeps(
        [report(4.0, True, "t2"), report(2.0, True, "t1"), report(8.0, False, "t3")]
    )
    assert [p["rate_rps"] for p in merged["points"]] == [2.0, 4.0, 8.0]
    assert list(merged["requests_by_rate"]) == ["2.0", "4.0", "8.0"]
    assert merged["goodput_rps"] == 4.0 and merged["lowest_failing_rps"] == 8.0
    assert merged["summary"] == {"rate": 4.0}  # the goodput rate's, as a sweep reports it
    assert merged["created_at"] == "t1"


def test_a_rate_passing_above_a_failing_one_does_not_count() -> None:
    merged = merge_sweeps([report(2.0, False, "a"), report(4.0, True, "b")])
    assert merged["goodput_rps"] == 0.0 and merged["lowest_failing_rps"] == 2.0


def test_a_rate_measured_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="twice"):
        merge_sweeps([report(2.0, True, "a"), report(2.0, True, "b")])
