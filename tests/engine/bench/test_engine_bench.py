"""``epdctl bench-engine --quick`` on the tiny model: every figure present, positive, finite."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from epd_engine.bench.engine_bench import EngineBenchConfig
from epd_engine.cli import main


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def result(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench-engine") / "engine.json"
    assert main(["bench-engine", "--model", str(tiny_model_dir), "--quick", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_every_figure_is_positive_and_finite(result: dict[str, Any], tiny_model_dir: Path) -> None:
    quick = EngineBenchConfig.quick(tiny_model_dir)
    assert [r["prompt_tokens"] for r in result["prefill"]] == list(quick.prefill_lengths)
    assert [r["batch"] for r in result["decode"]] == list(quick.decode_batches)
    assert [r["batch"] for r in result["encode"]] == list(quick.encode_batches)
    figures = {
        "prefill": ("ours_tokens_per_s", "hf_tokens_per_s", "ours_over_hf", "ours_ms", "hf_ms"),
        "decode": ("ours_tokens_per_s", "hf_tokens_per_s", "ours_over_hf", "ours_ms_per_step",
                   "hf_ms_per_step", "decode_tokens"),
        "encode": ("ours_images_per_s", "hf_images_per_s", "ours_over_hf", "ours_ms", "hf_ms"),
    }  # fmt: skip
    for section, names in figures.items():
        for row in result[section]:
            for name in names:
                assert _positive(row[name]), (section, row, name)
    for name, sizes in (("prefill_tokens_per_s", quick.prefill_lengths),
                        ("decode_tokens_per_s", quick.decode_batches),
                        ("decode_ours_over_hf", quick.decode_batches),
                        ("encode_images_per_s", quick.encode_batches)):  # fmt: skip
        summary = result["summary"][name]
        assert set(summary) == {str(s) for s in sizes}
        assert all(_positive(v) for v in summary.values()), (name, summary)


def test_decode_is_the_same_work_as_transformers(result: dict[str, Any]) -> None:
    for row in result["decode"]:
        assert row["decode_tokens"] == row["batch"] * (row["new_tokens_per_request"] - 1)
        assert row["ours_mixed_steps"] == 0  # prefill and decode timed apart
        assert row["greedy_outputs_match_hf"] is True


def test_records_machine_software_and_threads(result: dict[str, Any]) -> None:
    machine = result["machine"]
    assert _positive(machine["cpu_count"])
    for key in ("load_average_start", "load_average_end"):
        assert len(machine[key]) == 3 and all(math.isfinite(v) and v >= 0 for v in machine[key])
    assert result["software"]["torch"] and result["software"]["transformers"]
    assert result["threads"]["torch_threads"] == 1 and result["threads"]["fair"]
    assert result["model"]["preset"] == "tiny-llava"
    assert "bench-engine" in result["command"] and "--quick" in result["command"]
    # the shared metadata block every benchmark's JSON carries (bench/results_file.py)
    assert "bench-engine --model" in result["metadata"]["command"]
    assert result["metadata"]["machine"]["cpu_count"] == machine["cpu_count"]
