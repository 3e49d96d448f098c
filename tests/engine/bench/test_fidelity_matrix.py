"""The fidelity matrix's reading of each shape's report (``benchmarks/bench_fidelity_matrix.py``):
which cells are held out, the goal per workload, and its refusal of unknown shapes. The
real runs themselves are a benchmark (``make bench-fidelity-quick``), not a test."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from benchmarks.bench_fidelity_matrix import ROOT, summary


def point(rate: float, ttft_err: float, tpot_err: float) -> dict[str, Any]:
    interval = {"ttft_p90_s": [0.09, 0.11], "tpot_p90_s": [0.01, 0.02]}
    return {
        "rate_rps": rate,
        "real": {"ttft_p90_s": 0.1, "tpot_p90_s": 0.015, "p90_80pct_interval": interval},
        "sim": {"ttft_p90_s": 0.1 * (1 + ttft_err), "tpot_p90_s": 0.015 * (1 + tpot_err)},
        "ttft_p90_rel_error": ttft_err,
        "tpot_p90_rel_error": tpot_err,
    }


def report(calibrated_on: str | None, ttft_held_out: float, tpot_held_out: float) -> dict:
    rows = [
        {"method": "E+P+D", "calibration_run": calibrated_on == "E+P+D",
         "points": [point(1, 0.5, 0.5)]},
        {"method": "EPD", "calibration_run": False, "points": [point(1, 0.04, 0.02),
                                                                point(2, 0.3, 0.05)]},
    ]  # fmt: skip
    return {
        "methods": rows, "calibrated_on": calibrated_on,
        "ttft_p90_mean_rel_error_held_out": ttft_held_out,
        "tpot_p90_mean_rel_error_held_out": tpot_held_out,
        "goodput_rank_real": ["EPD", "E+P+D"], "goodput_rank_sim": ["EPD", "E+P+D"],
        "goodput_ranking_agrees": True, "loadavg": [1.0, 1.0, 1.0], "shape_elapsed_s": 1.0,
    }  # fmt: skip


def test_the_calibrating_cells_are_marked_and_left_out_of_the_worst_cell() -> None:
    row = summary("image-short", report("E+P+D", 0.17, 0.035))
    held = {(c["method"], c["rate_rps"]): c["held_out"] for c in row["cells"]}
    assert held == {("E+P+D", 1): False, ("EPD", 1): True, ("EPD", 2): True}
    assert row["ttft_p90_max_rel_error"] == 0.3  # E+P+D's 0.5 calibrated: not counted
    assert row["cells"][0]["real_p90_80pct_interval"]["ttft_p90_s"] == [0.09, 0.11]
    assert not row["goal_met"]  # 17 % TTFT


def test_the_goal_needs_both_errors_within_ten_percent() -> None:
    assert summary("mixed-long", report(None, 0.08, 0.09))["goal_met"]
    assert not summary("mixed-long", report(None, 0.08, 0.11))["goal_met"]
    assert not summary("mixed-long", report(None, None, 0.05))["goal_met"]  # type: ignore[arg-type]


def test_an_unknown_shape_is_refused_naming_the_known_ones() -> None:
    run = subprocess.run(
        [sys.executable, "benchmarks/bench_fidelity_matrix.py", "--shapes", "textcaps-ish",
         "--out", "/dev/null"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 2
    assert "unknown shape(s) textcaps-ish" in run.stderr and "multi-turn" in run.stderr
