from __future__ import annotations

from datetime import UTC, datetime, timedelta

from epd_operator.kube.controller import invalid_spec_status, merge_conditions
from epd_operator.planning.choice import WorkloadStats
from epd_operator.planning.plan_pass import from_snapshot, snapshot

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_workload_snapshot_round_trips_in_integers() -> None:
    stats = WorkloadStats(400, 1.25, mean_prompt_tokens=812.4, mean_images=1.5)
    snap = snapshot(stats)
    assert snap.request_rate_milli_rps == 1250 and snap.mean_images_milli == 1500
    assert snap.mean_output_tokens is None
    back = from_snapshot(snap)
    assert (back.request_rate_rps, back.mean_images, back.mean_prompt_tokens) == (1.25, 1.5, 812)


def test_last_transition_time_moves_only_when_status_flips() -> None:
    first = merge_conditions(
        [],
        {
            "Ready": ("False", "PoolsNotReady", "a"),
            "Progressing": ("True", "WaitingForPools", "b"),
            "Degraded": ("False", "AsExpected", "c"),
        },
        1,
        T0,
    )
    later = T0 + timedelta(seconds=30)
    second = merge_conditions(
        first,
        {
            "Ready": ("True", "AllPoolsReady", "a"),
            "Progressing": ("True", "Draining", "b"),
            "Degraded": ("False", "AsExpected", "c"),
        },
        2,
        later,
    )
    by_type = {c.type: c for c in second}
    assert by_type["Ready"].last_transition_time == "2026-01-01T00:00:30Z"
    assert by_type["Progressing"].last_transition_time == "2026-01-01T00:00:00Z"
    assert by_type["Progressing"].reason == "Draining"
    assert all(c.observed_generation == 2 for c in second)


def test_invalid_spec_is_reported_in_conditions() -> None:
    status = invalid_spec_status(None, "spec.gpuBudget: must be >= 1", 3)
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "InvalidSpec")
    assert degraded["message"] == "spec.gpuBudget: must be >= 1"
    assert status["observedGeneration"] == 3
