"""``epdctl bench-transfer`` at a small size: real page sources and the link peer as processes,
every backend pulled into this process, the limits measured, the JSON complete. Figures are
not asserted (a shared machine's timings are not a test); their presence and sanity are."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from epd_engine.bench.transfer_bench import BACKENDS, GOALS
from epd_engine.cli import main
from tests.engine.transfer.nixl_skip import NIXL_MISSING

# nixl runs where NIXL is installed (the dev extra); elsewhere the command leaves it out
RUN = [b for b in BACKENDS if b != "nixl" or NIXL_MISSING is None]


def positive(value: object) -> bool:
    return isinstance(value, int | float) and value > 0 and math.isfinite(value)


@pytest.mark.slow
def test_a_small_run_moves_every_backend_and_reports_each_ratio(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "transfer.json"
    argv = ["bench-transfer", "--model", str(tiny_model_dir), "--shapes", "tiny",
            "--num-tokens", "40", "--layers-per-group", "1", "--repeats", "2",
            "--page-repeats", "2", "--warmup", "1", "--out", str(out),
            "--run-dir", str(tmp_path / "logs"), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["kind"] == "epd-bench-transfer"
    assert {"command", "cpu_model", "loadavg_start", "loadavg_end", "versions"} <= set(
        report["environment"]
    )
    [shape] = report["shapes"]
    assert shape["name"] == "tiny" and shape["num_tokens"] == 40
    page_bytes = 2 * 16 * 2 * 16 * 4  # K and V x 16 tokens x 2 KV heads x head dim 16, fp32
    assert shape["kv_bytes"] == 3 * 2 * page_bytes  # 40 tokens in 3 pages, 2 layers
    assert set(shape["backends"]) == set(RUN)
    for name, result in shape["backends"].items():
        assert result["verified"], name  # the pages arrived exactly
        assert result["limit"] == GOALS[name][0]
        assert result["kv"]["num_transfers"] == 2  # one per layer group of one layer
        for case in ("kv", "image", "page"):
            c = result[case]
            assert c["pull"]["count"] == 2 and c["limit"]["count"] == 2
            pull, limit = c["pull"], c["limit"]
            figures = [pull["p50_s"], pull["p90_s"], pull["bandwidth_Bps"]]
            figures += [limit["bandwidth_Bps"], c["ratio"], c["paired_ratio"]["p50"]]
            assert all(positive(value) for value in figures), (name, case, figures)
        assert isinstance(result["kv"]["goal_met"], bool)
    assert len(report["summary"]) == len(RUN) * 2  # kv and image per backend
    table = capsys.readouterr().out
    assert all(name in table for name in RUN)
