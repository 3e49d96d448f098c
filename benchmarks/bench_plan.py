"""Plan-search benchmark (``make bench-plan``): exhaustive search speed and the heuristic's gap.

For each scenario (a 2,000-request trace, SLOs, a GPU budget; the synthetic reference cost
model of LLaVA-1.5-7B unless ``--cost-model`` is given) it runs

- the exhaustive search (every method and ratio, pruned by the goodput bound), timed in wall
  and CPU seconds (the host may be shared: the load average is recorded too);
- HydraInfer's heuristic on a fresh evaluator (timed separately, nothing cached);

and writes one JSON with the chosen plans, both tables and how much goodput the heuristic
leaves on the table. Target: exhaustive < 60 s for 32 GPUs x 2,000 requests on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from epd_engine.bench.arrivals import ArrivalSpec
from epd_engine.bench.workloads import synthesize
from epd_engine.config import SLO
from epd_engine.profiler.cost_model import load_cost_model
from epd_engine.profiler.evaluate import Evaluator
from epd_engine.profiler.reference import reference_cost_model
from epd_engine.profiler.search import exhaustive_search, heuristic_search, table_rows

# (name, workload, ttft_s, tpot_s): HydraInfer's TextCaps under a tight TTFT, and EPD-Serve's
# mixed VisualWebInstruct (half text-only, 64 tokens out) at its SLOs (2 s / 50 ms, 0.8 s / 30 ms).
SCENARIOS = {
    "textcaps-tight": ("textcaps", 0.3, 0.04),
    "visualwebinstruct-epdserve": ("visualwebinstruct", 2.0, 0.05),
    "visualwebinstruct-strict": ("visualwebinstruct", 0.8, 0.03),  # EPD-Serve's strict setting
}


def _timed(run: Any) -> tuple[Any, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = run()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def run_scenario(name: str, args: argparse.Namespace) -> dict[str, Any]:
    workload, ttft_s, tpot_s = SCENARIOS[name]
    cost = load_cost_model(args.cost_model) if args.cost_model else reference_cost_model()
    records = synthesize(workload, args.num, ArrivalSpec("poisson", 10.0), seed=args.seed)
    slo = SLO(ttft_s=ttft_s, tpot_s=tpot_s)
    load_before = os.getloadavg()
    evaluator = Evaluator(records, cost, slo, args.tolerance)
    exhaustive, wall, cpu = _timed(
        lambda: exhaustive_search(evaluator, args.gpus, num_workers=args.workers)
    )
    fresh = Evaluator(records, cost, slo, args.tolerance)
    heuristic, h_wall, h_cpu = _timed(lambda: heuristic_search(fresh, args.gpus))
    best = exhaustive.best.goodput_rps if exhaustive.best else 0.0
    pick = heuristic.best.goodput_rps if heuristic.best else 0.0
    gap = (1 - (pick or 0.0) / best) if best else None
    result = {
        "scenario": name,
        "workload": workload,
        "num_requests": len(records),
        "gpus": args.gpus,
        "slo": {"ttft_s": ttft_s, "tpot_s": tpot_s, "attainment": slo.attainment},
        "exhaustive": {
            "wall_s": round(wall, 2),
            "cpu_s_main_process": round(cpu, 2),
            "num_workers": args.workers,
            "num_candidates": exhaustive.num_candidates,
            "num_pruned": exhaustive.num_pruned,
            "num_simulations": exhaustive.num_simulations,
            "best": exhaustive.best.candidate.describe() if exhaustive.best else None,
            "goodput_rps": best,
            "table": table_rows(exhaustive, 15),
        },
        "heuristic": {
            "wall_s": round(h_wall, 2),
            "cpu_s": round(h_cpu, 2),
            "num_simulations": heuristic.num_simulations,
            "best": heuristic.best.candidate.describe() if heuristic.best else None,
            "goodput_rps": pick,
            "table": table_rows(heuristic, None),
        },
        "heuristic_goodput_gap": gap,
        "under_60_s": wall < 60,
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }
    print(
        f"{name}: exhaustive {exhaustive.best.candidate.describe() if exhaustive.best else '-'} "
        f"{best:.2f} rps in {wall:.1f}s wall / {cpu:.1f}s CPU "
        f"({exhaustive.num_simulations} simulations, {exhaustive.num_pruned}/"
        f"{exhaustive.num_candidates} pruned); heuristic {pick:.2f} rps "
        f"(gap {gap:.1%})"
        if gap is not None
        else f"{name}: no plan meets the SLO"
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=32)
    parser.add_argument("--num", type=int, default=2000, help="requests in the trace")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=0.05)
    parser.add_argument("--workers", type=int, default=2, help="parallel candidate checks")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated")
    parser.add_argument("--cost-model", help="cost model JSON (default: synthetic reference)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/plan-search.json"))
    args = parser.parse_args()
    results = [run_scenario(s.strip(), args) for s in args.scenarios.split(",") if s.strip()]
    report = {
        "kind": "epd-bench-plan",
        "version": 1,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "cost_model": "reference" if not args.cost_model else args.cost_model,
        "scenarios": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
