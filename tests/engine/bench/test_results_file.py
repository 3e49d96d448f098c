"""Results as a summary plus raw data apart (``results_file.py``), and bench reports on it."""

from __future__ import annotations

import gzip
import json
import subprocess
from pathlib import Path

import pytest

from epd_engine.bench.report import (
    build_report,
    load_report,
    results_by_rate,
    results_from_report,
    write_report,
)
from epd_engine.bench.results_file import (
    read_results,
    round_floats,
    run_metadata,
    write_results,
)
from epd_engine.config import SLO
from epd_engine.slo.goodput import sweep
from epd_engine.slo.outcomes import RequestResult, summarize

REPO = Path(__file__).resolve().parents[3]


def results(ttft_s: float, num: int = 10) -> list[RequestResult]:
    return [
        RequestResult(request_id=f"r{i}", arrival_s=0.1 * i, ttft_s=ttft_s * (1 + i / 10),
                      itl_s=(0.02, 0.03), e2e_s=ttft_s + 0.05, num_output_tokens=3,
                      stage_s={"encode": 0.01}, path=("E", "P", "D"))
        for i in range(num)
    ]  # fmt: skip


def sweep_report() -> tuple[dict, dict[float, list[RequestResult]]]:
    slo = SLO(ttft_s=1.0, tpot_s=0.05)
    by_rate: dict[float, list[RequestResult]] = {}

    def run(rate: float) -> list[RequestResult]:
        by_rate[rate] = results(0.2 * rate)
        return by_rate[rate]

    search = sweep(run, [1.0, 2.0, 8.0], slo)
    report = build_report(
        label="E+P+D", slo=slo, trace={"num_requests": 10}, summary=summarize(by_rate[2.0], slo),
        results=by_rate[2.0], search=search, mode="sweep",
        extra={"requests_by_rate": {str(r): [x.to_dict() for x in rs] for r, rs in by_rate.items()},
               "server_metrics": {"before": {"samples": {"a": 1.0}}, "after": {}, "delta": {}}},
    )  # fmt: skip
    return report, by_rate


def test_summary_in_git_raw_beside_it_and_the_report_loads_whole(tmp_path: Path) -> None:
    report, by_rate = sweep_report()
    path = write_report(report, tmp_path / "sweep.json")
    summary = json.loads(path.read_text())
    assert not {"requests", "requests_by_rate", "server_metrics"} & set(summary)
    assert summary["points"] == report["points"] and summary["summary"] == report["summary"]
    assert summary["raw_file"] == "raw/sweep.json.gz"
    assert summary["metadata"]["command"] and summary["metadata"]["machine"]["cpu_count"]
    raw = json.loads(gzip.decompress((tmp_path / "raw" / "sweep.json.gz").read_bytes()))
    assert raw["requests_rate"] == "2.0" and "requests" not in raw  # stored once
    loaded = load_report(path)
    assert results_from_report(loaded) == by_rate[2.0]
    assert results_by_rate(loaded) == by_rate
    assert loaded["server_metrics"] == report["server_metrics"]
    assert "raw_file" not in loaded and "requests_rate" not in loaded


def test_a_summary_without_its_raw_file_loads_and_says_so(tmp_path: Path) -> None:
    report, _ = sweep_report()
    path = write_report(report, tmp_path / "sweep.json")
    (tmp_path / "raw" / "sweep.json.gz").unlink()
    loaded = load_report(path)
    assert loaded["goodput_rps"] == 2.0  # every aggregate figure is in the summary
    with pytest.raises(ValueError, match=r"raw/sweep\.json\.gz, which is not here"):
        results_from_report(loaded)
    with pytest.raises(ValueError, match="not here"):
        results_by_rate(loaded)
    (tmp_path / "raw" / "sweep.json.gz").write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="not a readable raw results file"):
        load_report(path)


def test_a_report_from_before_the_split_still_loads(tmp_path: Path) -> None:
    report, by_rate = sweep_report()
    old = tmp_path / "old.json"
    old.write_text(json.dumps(report, indent=2))
    assert results_by_rate(load_report(old)) == by_rate


def test_no_raw_file_without_raw_data_and_same_data_same_bytes(tmp_path: Path) -> None:
    write_results(tmp_path / "s.json", {"x": 1}, {})
    assert not (tmp_path / "raw").exists() and "raw_file" not in read_results(tmp_path / "s.json")
    write_results(tmp_path / "a.json", {"x": 1}, {"rows": [1.5]}, metadata=False)
    first = (tmp_path / "raw" / "a.json.gz").read_bytes()
    write_results(tmp_path / "a.json", {"x": 1}, {"rows": [1.5]}, metadata=False)
    assert (tmp_path / "raw" / "a.json.gz").read_bytes() == first  # no mtime in the gzip
    assert read_results(tmp_path / "a.json") == {"x": 1, "rows": [1.5]}


def test_metadata_names_this_commit_and_the_command() -> None:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                          text=True, check=False).stdout.strip()  # fmt: skip
    meta = run_metadata(["epdctl", "bench", "--out", "a b.json"])
    assert meta["command"] == "epdctl bench --out 'a b.json'"
    assert meta["commit"] == (head or None)
    assert meta["created_at"].endswith("+00:00")


def test_round_floats_keeps_nanoseconds() -> None:
    assert round_floats({"a": [0.0013391270003921818, 2], "b": "x"}) == {
        "a": [0.001339127, 2],
        "b": "x",
    }


def test_compact_results_converts_an_old_report_and_checks_its_percentiles(
    tmp_path: Path,
) -> None:
    from benchmarks.compact_results import close
    from benchmarks.compact_results import main as compact

    report, by_rate = sweep_report()
    old = tmp_path / "old.json"
    old.write_text(json.dumps(report, indent=2))
    assert compact([str(old)]) == 0
    assert "requests_by_rate" not in json.loads(old.read_text())
    assert (tmp_path / "raw" / "old.json.gz").exists()
    back = results_by_rate(load_report(old))
    assert sorted(back) == sorted(by_rate)
    for rate, rs in by_rate.items():  # the same, floats to 1 ns
        assert close([r.to_dict() for r in back[rate]], [r.to_dict() for r in rs])
        assert not close([r.ttft_s for r in back[rate]], [(r.ttft_s or 0.0) + 2e-9 for r in rs])
    assert compact([str(old)]) == 0  # idempotent
    summary = json.loads(old.read_text())
    summary["points"][0]["summary"]["ttft"]["p90_s"] += 0.001  # a figure raw data do not give
    old.write_text(json.dumps(summary))
    with pytest.raises(SystemExit, match="ttft p90_s"):
        compact([str(old)])
