"""``make demo-loop``'s bookkeeping: switch markers from the loop's state, the timeline, the PNG."""

from __future__ import annotations

from pathlib import Path

from benchmarks.demo_loop import PlanPoint, Sample, decisions, plot, switches, timeline


def points() -> list[PlanPoint]:
    return [
        PlanPoint(0.0, "E+P+D 1E1P1D", "RolloutComplete", 1, "heuristic", "Planned: h"),
        PlanPoint(40.0, "EPD 3EPD", "WaitingForPools", 2, "profiler", "Replanned: p"),
        PlanPoint(70.0, "EPD 3EPD", "Draining", 2, "profiler", "Replanned: p"),
        PlanPoint(75.0, "EPD 3EPD", "RolloutComplete", 2, "profiler", "Replanned: p"),
        PlanPoint(100.0, "EPD 3EPD", "RolloutComplete", 2, "profiler", "KeptCurrentPlan: k"),
        PlanPoint(130.0, "E+PD 1E2PD", "WaitingForPools", 3, "shift", "Replanned: s"),
    ]


def test_switches_are_decided_then_serving() -> None:
    got = switches(points())
    assert got == [
        {"from": "E+P+D 1E1P1D", "to": "EPD 3EPD", "reason": "profiler",
         "decided_s": 40.0, "serving_s": 70.0, "complete_s": 75.0},
        {"from": "EPD 3EPD", "to": "E+PD 1E2PD", "reason": "shift",
         "decided_s": 130.0, "serving_s": None, "complete_s": None},
    ]  # fmt: skip
    assert [d["planned"] for d in decisions(points())] == [
        "Planned: h", "Replanned: p", "KeptCurrentPlan: k", "Replanned: s"
    ]  # fmt: skip


def test_timeline_bins_rate_attainment_and_plan(tmp_path: Path) -> None:
    samples = [
        Sample("text-heavy", "text", 0.0, 1.0, 0.5, 0.01, True, ""),
        Sample("text-heavy", "image", 1.0, 3.0, 5.0, 0.01, False, ""),
        Sample("image-heavy", "image", 44.0, 46.0, 0.5, 0.01, True, ""),
    ]
    rows = timeline(samples, points(), bin_s=5.0)
    assert len(rows) == 10
    assert rows[0]["rate_rps"] == 2 / 5 and rows[0]["attainment"] == 0.5
    assert rows[0]["text_rps"] == 0.2 and rows[0]["image_rps"] == 0.2
    assert rows[1]["attainment"] is None and rows[1]["rate_rps"] == 0
    assert rows[9]["plan"] == "EPD 3EPD" and rows[0]["plan"] == "E+P+D 1E1P1D"
    result = {
        "timeline": rows,
        "slo": {"attainment": 0.9},
        "plans": [vars(p) for p in points()],
        "phases": [{"start_s": 0.0}, {"start_s": 40.0}],
        "switches": switches(points()),
        "decisions": decisions(points()),
        "requests": 3,
        "failed": 0,
    }
    png = tmp_path / "t.png"
    plot(result, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
