"""Plan search on issue 19's mixed traces: this tree against an earlier commit, in one run.

Each search runs in a fresh process, the two trees alternating per (size, seed, repeat), so
both see the same host load; the JSON has every run's wall and CPU seconds (its workers
included), the load average before it, the chosen plan, and per size the ratios
before / after (median, min, max over seeds and repeats). The earlier tree is exported with
``git archive`` and put first on ``PYTHONPATH``; only planner APIs every version has are used.
``--after-ref`` exports the later tree too (default: this checkout, uncommitted edits and all).

    python benchmarks/bench_plan_ab.py --before-ref 12ef652 --seeds 3 --repeats 2
    python benchmarks/bench_plan_ab.py --before-ref 6f4f19a --sizes 256x10000 --workers 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def child(gpus: int, num: int, seed: int, workers: int) -> None:
    """One search in this process (the tree is whatever ``epd_engine`` imports from)."""
    import resource

    from mixed_trace import MIXED_SLO, mixed_trace

    import epd_engine
    from epd_engine.profiler.evaluate import Evaluator
    from epd_engine.profiler.reference import reference_cost_model
    from epd_engine.profiler.search import exhaustive_search

    def cpu_s() -> float:
        own = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    records = mixed_trace(num, seed)
    evaluator = Evaluator(records, reference_cost_model(), MIXED_SLO, 0.05)
    wall, cpu = time.perf_counter(), cpu_s()
    result = exhaustive_search(evaluator, gpus, show_progress=False, num_workers=workers)
    wall, cpu = time.perf_counter() - wall, cpu_s() - cpu
    best = result.best
    print(
        json.dumps(
            {
                "wall_s": round(wall, 3),
                "cpu_s_with_workers": round(cpu, 3),
                "num_simulations": result.num_simulations,
                "best": best.candidate.describe() if best else None,
                "goodput_rps": best.goodput_rps if best else 0.0,
                "package": str(Path(epd_engine.__file__).parent),
            }
        )
    )


def run_one(src: Path, gpus: int, num: int, seed: int, workers: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": f"{src}:{ROOT / 'benchmarks'}", "OMP_NUM_THREADS": "1"}
    load = os.getloadavg()[0]
    args = ["--child", str(gpus), str(num), str(seed), str(workers)]
    out = subprocess.run(
        [sys.executable, __file__, *args], env=env, check=True, capture_output=True, text=True
    )
    row: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["package"].startswith(str(src)), f"imported {row['package']}, not {src}"
    return {**row, "loadavg_1m_before": round(load, 2)}


def _ratios(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 2),
        "min": round(min(values), 2),
        "max": round(max(values), 2),
    }


def _export(ref: str, into: Path) -> Path:
    """Commit ``ref``'s ``engine/`` under ``into``; returns that ``engine/``."""
    into.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ref, "engine"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "engine"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before-ref", required=True, help="git commit of the 'before' tree")
    parser.add_argument("--after-ref", help="git commit of the 'after' tree (default: this one)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sizes", default="8x1000,32x2000", help="GPUsxrequests, comma-separated")
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/plan-search-mixed-ab.json")
    )
    args = parser.parse_args()
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",") if s]
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": _export(args.before_ref, Path(tmp) / "before")}
        after = _export(args.after_ref, Path(tmp) / "after") if args.after_ref else ROOT / "engine"
        trees["after"] = after
        runs = []
        for gpus, num in sizes:
            for seed in range(args.seeds):
                for repeat in range(args.repeats):
                    row: dict[str, Any] = {"gpus": gpus, "num_requests": num, "seed": seed}
                    row["repeat"] = repeat
                    for name, src in trees.items():
                        row[name] = run_one(src, gpus, num, seed, args.workers)
                        row[name].pop("package")
                    row["same_plan"] = row["before"]["best"] == row["after"]["best"]
                    runs.append(row)
                    print(json.dumps(row), flush=True)
    summary = {}
    for gpus, num in sizes:
        rows = [r for r in runs if (r["gpus"], r["num_requests"]) == (gpus, num)]
        summary[f"{gpus}x{num}"] = {
            key: _ratios([r["before"][key] / r["after"][key] for r in rows])
            for key in ("wall_s", "cpu_s_with_workers")
        } | {
            "after_wall_s": _ratios([r["after"]["wall_s"] for r in rows]),
            "same_plan": all(r["same_plan"] for r in rows),
        }
    report = {
        "kind": "epd-bench-plan-ab",
        "version": 1,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": {"cpus": os.cpu_count()},
        "before_ref": args.before_ref,
        "after_ref": args.after_ref
        or subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip(),
        "workers": args.workers,
        "ratios_before_over_after": summary,
        "runs": runs,
    }
    # this tree's helper: the parent process is always the current tree
    from epd_engine.bench.results_file import write_results

    write_results(args.out, report)
    print(json.dumps(summary, indent=2))
    print(f"results: {args.out}")


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        child(*(int(x) for x in sys.argv[2:]))
    else:
        main()
