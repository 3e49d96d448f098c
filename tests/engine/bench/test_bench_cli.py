"""``epdctl trace`` and ``epdctl bench`` end to end (bench against the fake OpenAI server)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from epd_engine.bench.report import load_report, results_by_rate
from epd_engine.cli import main
from epd_engine.contracts.trace import read_trace
from tests.engine.bench.fake_openai import FakeOpenAI


def test_trace_generate_show_scale_window(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    args = ["trace", "generate", "--workload", "textcaps", "--rate", "2", "--num", "40", "-o"]
    assert main([*args, str(trace)]) == 0
    assert len(read_trace(trace)) == 40
    assert main(["trace", "show", str(trace), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert shown["num_requests"] == 40 and shown["mean_image_tokens"] == 576
    fast = tmp_path / "fast.jsonl"
    assert main(["trace", "scale", str(trace), "--rate", "8", "-o", str(fast)]) == 0
    assert json.loads(json.dumps(shown))["digest"] != ""
    from epd_engine.contracts.trace import mean_rate_rps

    assert mean_rate_rps(read_trace(fast)) == pytest.approx(8.0)
    last = tmp_path / "last.jsonl"
    assert main(["trace", "window", str(fast), "--last", "1", "-o", str(last)]) == 0
    assert 1 <= len(read_trace(last)) <= 10
    assert main(["trace", "workloads"]) == 0
    mm = tmp_path / "mm.jsonl"
    mm_args = ["--workload", "random-mm", "--rate", "4", "--num", "20", "--input-len", "2000",
               "--images-per-request", "3", "--image-size", "320x240", "--model-family",
               "qwen2-vl", "-o", str(mm)]  # fmt: skip
    assert main(["trace", "generate", *mm_args]) == 0
    assert {(r.prompt_tokens, r.num_images, r.image_tokens) for r in read_trace(mm)} == {
        (2000, 3, 3 * 99)  # Qwen2-VL: round(320/28) x round(240/28) = 11 x 9
    }
    hist, rest = tmp_path / "h.jsonl", tmp_path / "r.jsonl"
    split = ["trace", "split", str(trace), "--history", str(hist), "--rest", str(rest)]
    assert main(split) == 0
    assert (len(read_trace(hist)), len(read_trace(rest))) == (4, 36)


def test_user_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0, "prompt_tokens": 1, "output_tokens": 1}\n{"arrival_s": 0}\n')
    assert main(["trace", "show", str(bad)]) == 2
    assert f"{bad}:2:" in capsys.readouterr().err
    assert main(["trace", "generate", "--workload", "nope", "--rate", "1", "-o", "x"]) == 2
    assert "unknown workload" in capsys.readouterr().err
    args = ["trace", "generate", "--workload", "pope", "--rate", "1", "--input-len", "5", "-o", "x"]
    assert main(args) == 2
    assert "only apply to --workload random-mm" in capsys.readouterr().err
    assert main(["bench", "--trace", str(bad)]) == 2  # no endpoint
    assert "--endpoint is required" in capsys.readouterr().err
    assert main(["bench", "--endpoint", "http://127.0.0.1:9/v1", "--trace", str(bad)]) == 2
    assert "bad.jsonl:2:" in capsys.readouterr().err
    good = tmp_path / "good.jsonl"
    good.write_text('{"arrival_s": 0, "prompt_tokens": 1, "output_tokens": 1}\n')
    assert main(["bench", "--endpoint", "http://127.0.0.1:9/v1", "--trace", str(good)]) == 2
    assert "pass --model" in capsys.readouterr().err


def test_bench_single_run_writes_report_trace_and_plots(
    fake_openai: FakeOpenAI, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_openai.behaviour.stage_s = {"encode": 0.01, "prefill": 0.02}
    out, plots, measured = tmp_path / "r.json", tmp_path / "plots", tmp_path / "m.jsonl"
    args = ["bench", "--endpoint", fake_openai.url, "--workload", "pope", "--rate", "50",
            "--num", "12", "--slo-ttft", "1", "--slo-tpot", "0.1", "--no-progress",
            "--label", "E+P+D", "--out", str(out), "--plots", str(plots),
            "--save-trace", str(measured)]  # fmt: skip
    assert main(args) == 0
    report = load_report(out)
    assert report["model"] == "fake-model"  # discovered via /v1/models
    assert report["summary"]["num_ok"] == 12 and report["summary"]["attainment"] == 1.0
    assert len(report["requests"]) == 12
    assert all(r.ttft_s is not None for r in read_trace(measured))
    assert {p.name for p in plots.iterdir()} == {"latency_cdf.png", "stage_breakdown.png"}
    assert "SLO attainment 100.0%" in capsys.readouterr().out


def test_bench_sweep_and_plot_only_compare(fake_openai: FakeOpenAI, tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    main(["trace", "generate", "--workload", "mme", "--rate", "1", "--num", "8", "-o", str(trace)])
    out = tmp_path / "sweep.json"
    args = ["bench", "--endpoint", fake_openai.url, "--model", "fake-model", "--trace",
            str(trace), "--sweep", "20,40", "--no-progress", "--label", "EPD",
            "--out", str(out),
            # SLOs far above the fake server's latencies: this test is about the sweep's
            # report, and a busy CI machine must not turn one slow token into a miss.
            "--slo-ttft", "30", "--slo-tpot", "5"]  # fmt: skip
    assert main(args) == 0
    report = load_report(out)
    assert [p["rate_rps"] for p in report["points"]] == [20.0, 40.0]
    assert report["goodput_rps"] == 40.0 and report["mode"] == "sweep"
    every_rate = results_by_rate(report)
    assert sorted(every_rate) == [20.0, 40.0]
    assert [len(results) for results in every_rate.values()] == [8, 8]
    plots = tmp_path / "cmp"
    assert main(["bench", "--compare", str(out), str(out), "--plots", str(plots)]) == 0
    assert {p.name for p in plots.iterdir()} == {
        "attainment_vs_rate.png", "latency_cdf.png", "stage_breakdown.png"
    }  # fmt: skip


def shared_prefix(a: str, b: str) -> int:
    """Characters two texts share at their start."""
    return sum(
        1 for _ in itertools.takewhile(lambda pair: pair[0] == pair[1], zip(a, b, strict=False))
    )


def test_bench_concurrency_sweep_with_tokenizer_export_and_metrics(
    tmp_path: Path,
    fake_openai: FakeOpenAI,
    tiny_model_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Closed-loop sweep from a Mooncake trace with exact prompts: the report says how lengths
    were built, keeps every level, and records the /metrics capture (the fake has none)."""
    mooncake = Path(__file__).parents[2] / "data" / "mooncake_sample.jsonl"
    out, rows = tmp_path / "r.json", tmp_path / "rows.jsonl"
    args = ["bench", "--endpoint", fake_openai.url, "--model", "fake-model", "--trace",
            str(mooncake), "--tokenizer", str(tiny_model_dir), "--prompt-count", "content",
            "--concurrency", "1,2", "--warmup", "1", "--no-progress", "--out", str(out),
            "--export-requests", str(rows)]  # fmt: skip
    assert main(args) == 0
    assert "exact token counts" in capsys.readouterr().out
    report = load_report(out)
    assert report["mode"] == "concurrency"
    assert [p["concurrency"] for p in report["concurrency_points"]] == [1, 2]
    assert report["workload"]["prompt_tokens"] == "exact"
    assert report["workload"]["prompt_count"] == "content"
    assert "error" in report["server_metrics"]["before"]  # the fake serves no /metrics
    lines = [json.loads(line) for line in rows.read_text().splitlines()]
    assert sorted({line["concurrency"] for line in lines}) == [1, 2] and len(lines) == 8
    assert len(fake_openai.requests) == 2 * (1 + 4)  # warm-up + trace, per level
    # hash_ids [0, 1] start the first and last request, [3] the third: 512-token blocks
    texts = [r["messages"][0]["content"] for r in fake_openai.requests[1:5]]
    assert shared_prefix(texts[0], texts[3]) > 1000
    assert shared_prefix(texts[0], texts[2]) < 20
