"""bench-switch's breakdown of decision -> new plan serving (``switch_drill.phases``): the
slowest new replica's start, phase by phase, adds up to the measured time."""

from __future__ import annotations

from benchmarks.switch_drill import Switch, phases
from epd_operator.local.pools import StartupTimeline


def _switch(started: list[StartupTimeline]) -> Switch:
    s = Switch("E+P+D 1E1P1D", "EP+D 1EP1D", decided_s=50.0, decided_wall=1000.0)
    s.serving_s = 50.0 + 9.0  # monotonic: 9 s after the decision
    s.started = started
    return s


def test_the_replica_seen_ready_last_is_broken_down_and_sums_to_serving() -> None:
    fast = StartupTimeline("ep-0", "ep", 1000.1, {"main": 1000.2, "imports": 1001.0}, 1004.0)
    marks = {
        "main": 1000.3, "imports": 1002.3, "model_loaded": 1004.0, "budgets": 1004.5,
        "engine_built": 1007.0, "serving": 1007.2, "registered": 1007.4,
    }  # fmt: skip
    slow = StartupTimeline("ep-1", "ep", 1000.2, marks, 1008.0)
    out = phases(_switch([fast, slow]))
    assert out is not None
    assert out["spawn"] == 0.2 and out["imports"] == 2.0 and out["model_load"] == 1.7
    assert out["budgets"] == 0.5 and out["engine_rest"] == 2.5 and out["register"] == 0.2
    assert out["seen_ready"] == 0.6 and out["switch"] == 1.0
    parts = [v for k, v in out.items() if not k.startswith("replica")]
    assert round(sum(parts), 2) == 9.0  # decision -> serving
    assert out["replicas_started"] == 2
    assert out["replica_start_to_ready_min_s"] == 3.9
    assert out["replica_start_to_ready_max_s"] == 7.8


def test_no_breakdown_without_new_replicas_or_serving() -> None:
    assert phases(_switch([])) is None
    s = _switch([StartupTimeline("p-0", "p", 1000.1, {}, None)])
    assert phases(s) is None  # never seen Ready
    s.serving_s = None
    assert phases(s) is None
