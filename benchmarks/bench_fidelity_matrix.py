"""Simulator fidelity as a matrix (``make bench-fidelity``, ``make bench-fidelity-quick``):
several workload shapes, **one calibration**.

The first shape runs ``bench_fidelity.py`` as usual: its first method's real run at the
lowest rate calibrates the cost model's overheads. Every other shape reuses that calibrated
model unchanged (``--cost-model ... --no-calibrate``), so all of its methods are held out:
what the matrix asks is whether one calibration, on one workload at one rate, predicts the
others (issue 37). Shapes (tiny model on CPU):

- ``image-short``: TextCaps-shaped, one image and a short caption per request (the shape the
  simulator was developed on);
- ``mixed-long``: VisualWebInstruct-shaped, half the requests text-only, 1280x720 images,
  64 tokens out;
- ``multi-image``: random-mm, 2 images per request (1-3), 100 text tokens, 32 tokens out;
- ``multi-turn``: conversations of 2-4 turns resent whole, pictures in some, the engines'
  prefix cache on (``workload/conversations.py``; a fresh system per rate, no warm-up), so
  the simulator's prefix and answer-page model meets the real caches (issue 33).

Per workload x method x rate it reports the p90 TTFT and TPOT relative errors
(|sim - real| / real) beside the real run's own 80 % bootstrap interval of its p90 (an error
inside the real run's spread is noise, not model error), per workload the held-out mean
errors and whether the goodput ranking agrees, and the goal (p90 TTFT and TPOT mean error
<= 10 % on every shape for the held-out methods). A benchmark, not a gate: a shared host's
timing is too noisy to fail a build on.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from epd_engine.bench.results_file import write_results

ROOT = Path(__file__).resolve().parent.parent
SHAPES: dict[str, list[str]] = {
    "image-short": ["--workload", "textcaps"],
    "mixed-long": ["--workload", "visualwebinstruct"],
    "multi-image": [
        "--workload", "random-mm", "--trace-args",
        "--input-len 100 --output-len 32 --images-per-request 2 --images-range-ratio 0.5 "
        "--image-size 336x336",
    ],
    "multi-turn": ["--workload", "multiturn"],
}  # fmt: skip
GOAL_MEAN_REL_ERROR = 0.10
QUICK = {"num": 20, "rates": "1,2", "sim_seeds": 3}
FULL = {"num": 100, "rates": "1,2,3", "sim_seeds": 9}


def run_shape(shape: str, args: argparse.Namespace, size: dict[str, Any],
              calibrated: Path | None) -> dict[str, Any]:  # fmt: skip
    """One shape through ``bench_fidelity.py``; its report."""
    results = args.results / shape
    out = results / "fidelity.json"
    command = [
        sys.executable, str(ROOT / "benchmarks" / "bench_fidelity.py"), *SHAPES[shape],
        "--model-dir", str(args.model_dir), "--results", str(results),
        "--runs-dir", str(args.runs_dir / shape), "--num", str(size["num"]),
        "--rates", size["rates"], "--sim-seeds", str(size["sim_seeds"]),
        "--slo-ttft", str(args.slo_ttft), "--slo-tpot", str(args.slo_tpot), "--out", str(out),
    ]  # fmt: skip
    if calibrated is not None:
        command += ["--cost-model", str(calibrated), "--no-calibrate"]
    print(f"== {shape}: {' '.join(command[2:])}", flush=True)
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT)
    report: dict[str, Any] = json.loads(out.read_text())
    report["shape_elapsed_s"] = round(time.perf_counter() - started, 1)
    return report


def cells(report: dict[str, Any]) -> list[dict[str, Any]]:
    """workload x method x rate: the errors and the real p90s' bootstrap intervals."""
    out = []
    for row in report["methods"]:
        for p in row["points"]:
            interval = p["real"].get("p90_80pct_interval") or {}
            out.append({
                "method": row["method"], "held_out": not row["calibration_run"],
                "rate_rps": p["rate_rps"],
                "ttft_p90_real_s": p["real"]["ttft_p90_s"],
                "ttft_p90_sim_s": p["sim"].get("ttft_p90_s"),
                "ttft_p90_rel_error": p["ttft_p90_rel_error"],
                "tpot_p90_real_s": p["real"]["tpot_p90_s"],
                "tpot_p90_sim_s": p["sim"].get("tpot_p90_s"),
                "tpot_p90_rel_error": p["tpot_p90_rel_error"],
                "real_p90_80pct_interval": interval,
            })  # fmt: skip
    return out


def summary(shape: str, report: dict[str, Any]) -> dict[str, Any]:
    ttft = report["ttft_p90_mean_rel_error_held_out"]
    tpot = report["tpot_p90_mean_rel_error_held_out"]
    table = cells(report)
    return {
        "workload": shape,
        "trace": " ".join(SHAPES[shape]),
        "calibrated_here": report["calibrated_on"],
        "ttft_p90_mean_rel_error_held_out": ttft,
        "tpot_p90_mean_rel_error_held_out": tpot,
        "ttft_p90_max_rel_error": max(
            (
                c["ttft_p90_rel_error"]
                for c in table
                if c["held_out"] and c["ttft_p90_rel_error"] is not None
            ),
            default=None,
        ),
        "goodput_rank_real": report["goodput_rank_real"],
        "goodput_rank_sim": report["goodput_rank_sim"],
        "goodput_ranking_agrees": report["goodput_ranking_agrees"],
        "goal_met": ttft is not None
        and tpot is not None
        and ttft <= GOAL_MEAN_REL_ERROR
        and tpot <= GOAL_MEAN_REL_ERROR,
        "loadavg_at_end": report["loadavg"],
        "elapsed_s": report["shape_elapsed_s"],
        "cells": table,
    }


def pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| workload | method | rate | p90 TTFT err | p90 TPOT err | real TTFT p90 80% interval |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        for c in row["cells"]:
            iv = c["real_p90_80pct_interval"].get("ttft_p90_s") or []
            span = f"{iv[0]:.3f}-{iv[1]:.3f} s" if len(iv) == 2 else ""
            mark = "" if c["held_out"] else " (calibrating)"
            errors = f"{pct(c['ttft_p90_rel_error'])} | {pct(c['tpot_p90_rel_error'])}"
            print(f"| {row['workload']} | {c['method']}{mark} | {c['rate_rps']:g} | {errors} | "
                  f"{span} |")  # fmt: skip
    for row in rows:
        print(f"{row['workload']}: held-out p90 TTFT {pct(row['ttft_p90_mean_rel_error_held_out'])}"
              f", TPOT {pct(row['tpot_p90_mean_rel_error_held_out'])}, ranking "
              f"{'agrees' if row['goodput_ranking_agrees'] else 'differs'}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="20 requests, rates 1 and 2")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="the first calibrates")
    parser.add_argument("--model-dir", type=Path, default=ROOT / "models" / "tiny-llava")
    parser.add_argument("--results", type=Path, default=ROOT / "runs" / "fidelity-matrix")
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "fidelity-matrix-runs")
    parser.add_argument("--slo-ttft", type=float, default=0.75)
    parser.add_argument("--slo-tpot", type=float, default=0.1)
    parser.add_argument(
        "--calibrated",
        type=Path,
        help="a calibrated cost model from an earlier matrix run: every shape reuses it and "
        "none calibrates (to add a shape to a matrix already run)",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shape(s) {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    size = QUICK if args.quick else FULL
    started = time.perf_counter()
    rows, calibrated = [], args.calibrated
    for shape in shapes:
        report = run_shape(shape, args, size, calibrated)
        rows.append(summary(shape, report))
        if calibrated is None:
            calibrated = args.results / shape / "cost-model-calibrated.json"
    result = {
        "kind": "epd-bench-fidelity-matrix",
        "version": 1,
        "form": "quick" if args.quick else "full",
        "size": size,
        "calibration": {
            "workload": "an earlier run's" if args.calibrated else shapes[0],
            "cost_model": str(calibrated),
        },
        "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
        "goal": f"held-out p90 TTFT and TPOT mean |error| <= {GOAL_MEAN_REL_ERROR:.0%} "
        "on every workload (errors are |sim - real| / real)",
        "goal_met": all(r["goal_met"] for r in rows),
        "workloads": rows,
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    write_results(args.out, result)
    print_table(rows)
    print(f"goal met: {result['goal_met']}; results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
