from __future__ import annotations

import json
from pathlib import Path

import pytest

from epd_engine.bench.report import load_report
from epd_engine.cli import main
from epd_engine.contracts.plan import Plan
from epd_engine.contracts.trace import write_trace
from epd_engine.profiler.cost_model import load_cost_model, save_cost_model
from tests.processes import rank_pids

from .factories import make_trace, toy_cost_model


@pytest.fixture()
def inputs(tmp_path: Path) -> tuple[Path, Path]:
    trace = write_trace(
        make_trace(num=40, rate_rps=20, output_tokens=3, text_only_every=4),
        tmp_path / "trace.jsonl",
    )
    cost = save_cost_model(toy_cost_model(), tmp_path / "cost.json")
    return trace, cost


def test_simulate_writes_a_bench_report(inputs: tuple[Path, Path], tmp_path: Path) -> None:
    trace, cost = inputs
    out = tmp_path / "sim.json"
    argv = [
        "simulate",
        "--trace",
        str(trace),
        "--cost-model",
        str(cost),
        "--pools",
        "1E1P1D",
        "--slo-ttft",
        "1",
        "--slo-tpot",
        "0.1",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    report = load_report(out)
    assert report["summary"]["num_requests"] == 40
    assert report["summary"]["num_ok"] == 40
    assert report["plan"]["method"] == "E+P+D"


def test_plan_writes_a_valid_plan_and_simulate_replays_it(
    inputs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace, cost = inputs
    plan_path, report_path = tmp_path / "plan.json", tmp_path / "search.json"
    argv = [
        "plan",
        "--trace",
        str(trace),
        "--cost-model",
        str(cost),
        "--gpus",
        "3",
        "--slo-ttft",
        "0.5",
        "--slo-tpot",
        "0.05",
        "--no-progress",
        "--workers",
        "1",
        "--out",
        str(plan_path),
        "--report",
        str(report_path),
    ]
    assert main(argv) == 0
    plan = Plan.model_validate_json(plan_path.read_text())
    assert plan.num_instances == 3 and plan.predicted is not None
    search = json.loads(report_path.read_text())
    assert search["exhaustive"]["num_candidates"] == 1 + 3 * 2 + 1  # EPD, 3 x C(2,1), E+P+D
    assert "chosen:" in capsys.readouterr().out
    argv = [
        "simulate",
        "--trace",
        str(trace),
        "--cost-model",
        str(cost),
        "--plan",
        str(plan_path),
        "--slo-ttft",
        "0.5",
        "--slo-tpot",
        "0.05",
    ]
    assert main(argv) == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "--pools", "1E1P1D"], "give a trace"),
        (["simulate", "--workload", "textcaps", "--rate", "5", "--pools", "3Q"], "expected e.g."),
        (["simulate", "--workload", "textcaps", "--rate", "5"], "exactly one of --plan"),
        (["plan", "--workload", "textcaps", "--rate", "5", "--gpus", "0"], "--gpus must be"),
        (  # a zero step made the rate grid raise a bare ValueError (a traceback, no flag named)
            ["plan", "--workload", "textcaps", "--rate", "5", "--gpus", "2", "--tolerance", "0"],
            "--tolerance must be",
        ),
        (
            ["plan", "--workload", "textcaps", "--rate", "5", "--gpus", "2", "--methods", "X+Y"],
            "known:",
        ),
        (
            [
                "simulate",
                "--workload",
                "textcaps",
                "--rate",
                "5",
                "--pools",
                "1EPD",
                "--slo-ttft",
                "1",
                "--slo-tpot",
                "0.0001",
            ],
            "no batch budget",
        ),
    ],
)
def test_user_mistakes_get_clear_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_profile_costs_measures_the_real_runner(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    argv = [
        "profile-costs",
        "--model",
        str(tiny_model_dir),
        "--out",
        str(out),
        "--max-images",
        "2",
        "--max-prefill-tokens",
        "32",
        "--max-decode-batch",
        "2",
        "--repeats",
        "1",
        "--rounds",
        "1",
        "--no-progress",
    ]
    assert main(argv) == 0
    cost = load_cost_model(out)
    assert cost.capacity.tokens_per_image == 16  # tiny-llava: (56 / 14)^2
    assert cost.meta["software"]["torch"]
    assert cost.meta["hardware"]["num_threads"] == 1  # as each engine instance runs on CPU
    assert cost.meta["model"]["config_sha256"]
    assert cost.meta["budgets"]["EPD"] is not None
    assert cost.language.fixed_s + cost.language.per_token_s > 0
    assert set(cost.links) == {"tcp", "shm", "collective"}  # measured across processes
    assert cost.transfer_backend == "shm"  # auto on one host, as `epdctl up` deploys
    assert cost.migration.bytes_per_s == cost.links["shm"].bytes_per_s
    assert cost.migration.kv_transfers == 1  # tiny-llava: 2 layers, one group of 8
    # what the plan search projects tensor-parallel sizes from (issue 34)
    assert cost.ranks is not None and cost.ranks.link == cost.links["collective"]
    assert cost.ranks.sizes == (1, 2)  # tiny-llava: 2 KV heads
    assert cost.ranks.shape.num_layers == 2 and cost.ranks.weight_bytes > 0


@pytest.mark.slow
def test_profile_costs_times_a_tensor_parallel_language_model(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Issue 34: the cost of a TP=2 instance is measured on its two ranks (gloo here), and
    they are gone once the profile is written."""
    out = tmp_path / "cost.json"
    argv = ["profile-costs", "--model", str(tiny_model_dir), "--out", str(out)]
    argv += ["--max-images", "2", "--max-prefill-tokens", "32", "--max-decode-batch", "2"]
    argv += ["--repeats", "1", "--rounds", "1", "--no-progress", "--tensor-parallel-size", "2"]
    assert main(argv) == 0
    cost = load_cost_model(out)
    assert cost.meta["tensor_parallel_size"] == 2
    assert cost.language.fixed_s + cost.language.per_token_s > 0
    assert not rank_pids()


def test_profile_costs_on_qwen2_vl_charges_images_by_their_trace_tokens(
    tiny_qwen2_vl_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "cost.json"
    samples = tmp_path / "samples.json"
    argv = ["profile-costs", "--model", str(tiny_qwen2_vl_dir), "--out", str(out)]
    argv += ["--max-images", "2", "--max-prefill-tokens", "32", "--max-decode-batch", "2"]
    argv += ["--repeats", "1", "--rounds", "1", "--no-progress", "--samples", str(samples)]
    assert main(argv) == 0
    encodes = [s for s in json.loads(samples.read_text()) if s["kind"] == "encode"]
    per_image = {s["image_tokens"] // s["num_images"] for s in encodes}
    assert per_image == {64, 256, 1024}  # 224, 448 and 896 pixels: the fit spans image sizes
    cost = load_cost_model(out)
    assert cost.capacity.tokens_per_image is None  # by resolution: the trace says
    assert cost.image_tokens(77) == 77
    assert cost.capacity.image_block_tokens == 64
    assert cost.encode.per_token_s > 0


def test_plan_compares_with_the_heuristic_only_when_asked(
    inputs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 32 item 6: the side comparison with HydraInfer's heuristic took about 11 of 12 s
    of a default 8-GPU, 1,000-request ``epdctl plan``; it is opt-in now."""
    trace, cost = inputs
    base = ["plan", "--trace", str(trace), "--cost-model", str(cost), "--gpus", "3"]
    base += ["--slo-ttft", "0.5", "--slo-tpot", "0.05", "--no-progress", "--workers", "1"]
    plain, compared = tmp_path / "plain.json", tmp_path / "compared.json"
    assert main([*base, "--report", str(plain)]) == 0
    assert json.loads(plain.read_text())["heuristic"] is None
    assert "HydraInfer heuristic" not in capsys.readouterr().out
    assert main([*base, "--compare-heuristic", "--report", str(compared)]) == 0
    assert json.loads(compared.read_text())["heuristic"]["table"]
    assert "HydraInfer heuristic" in capsys.readouterr().out
    assert main([*base, "--no-heuristic"]) == 0  # still accepted: the default now
