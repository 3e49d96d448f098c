from __future__ import annotations

from pathlib import Path

import pytest

from epd_engine.bench.plots import plot_attainment, plot_latency_cdfs, plot_stage_breakdown
from epd_engine.bench.report import (
    attainment_curve,
    build_report,
    load_report,
    results_from_report,
    write_report,
)
from epd_engine.config import SLO
from epd_engine.slo.goodput import sweep
from epd_engine.slo.outcomes import RequestResult, summarize

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def results(ttft_s: float) -> list[RequestResult]:
    return [
        RequestResult(request_id=f"r{i}", arrival_s=0.1 * i, ttft_s=ttft_s * (1 + i / 10),
                      itl_s=(0.02, 0.03), e2e_s=ttft_s + 0.05, num_output_tokens=3,
                      stage_s={"encode": 0.01, "prefill": 0.1}, path=("E", "P", "D"))
        for i in range(10)
    ]  # fmt: skip


def test_report_round_trip(tmp_path: Path) -> None:
    slo = SLO(ttft_s=1.0, tpot_s=0.05)
    search = sweep(lambda rate: results(0.2 * rate), [1.0, 2.0, 8.0], slo)
    runs = results(0.2)
    report = build_report(
        label="E+P+D", slo=slo, trace={"num_requests": 10}, summary=summarize(runs, slo),
        results=runs, search=search, mode="sweep",
    )  # fmt: skip
    loaded = load_report(write_report(report, tmp_path / "r.json"))
    assert attainment_curve(loaded) == [(1.0, 1.0), (2.0, 1.0), (8.0, 0.0)]
    assert loaded["goodput_rps"] == 2.0 and loaded["lowest_failing_rps"] == 8.0
    assert results_from_report(loaded) == runs
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(ValueError, match="not an epd-bench report"):
        load_report(tmp_path / "x.json")


def test_plots_are_pngs(tmp_path: Path) -> None:
    curves = {"E+P+D": [(1.0, 1.0), (2.0, 0.95), (4.0, 0.4)], "EPD": [(1.0, 0.9), (2.0, 0.3)]}
    paths = [
        plot_attainment(curves, tmp_path / "a.png", goodputs={"E+P+D": 2.0}),
        plot_latency_cdfs(
            {"E+P+D": results(0.2), "EPD": results(0.5)},
            tmp_path / "c.png",
            SLO(ttft_s=1.0, tpot_s=0.05),
        ),
        plot_stage_breakdown(
            {"E+P+D": {"encode": 0.1, "prefill": 0.3}, "EPD": {"decode": 1.0}}, tmp_path / "s.png"
        ),
    ]
    for path in paths:
        assert path.read_bytes()[:8] == PNG_MAGIC
