"""Plan-search benchmark (``make bench-plan``): exhaustive search speed and the heuristic's gap.

``--mixed``: issue 19's mixed traffic (0-3 LLaVA images, prompts 20-600, outputs 10-300,
Poisson 40 req/s, SLO 0.5 s / 40 ms) with several seeds, the search before (continuous
bisection, the engine scheduler in the simulator) and after (rate grid, ``SimScheduler``) in
one run, whether both chose the same plan, a scaling table (``--scale-requests``,
``--scale-gpus``) and the fleet sizes the elastic loop plans for (``--fleet 256x10000``:
after only, the search before issue 19 would take hours there; ``bench_plan_ab.py`` compares
it with an earlier commit). Timings on a shared host: read the ratios and the recorded load.

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
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mixed_trace import MIXED, MIXED_RATE_RPS, MIXED_SLO, mixed_trace

from epd_engine.bench.results_file import write_results
from epd_engine.config import SLO, Role
from epd_engine.contracts.plan import Budgets
from epd_engine.contracts.trace import TraceRecord
from epd_engine.profiler import simulator
from epd_engine.profiler.cost_model import Capacity, load_cost_model
from epd_engine.profiler.evaluate import Evaluator
from epd_engine.profiler.reference import reference_cost_model
from epd_engine.profiler.search import exhaustive_search, heuristic_search, table_rows
from epd_engine.profiler.search_legacy import bisection_search
from epd_engine.profiler.sim_instance import build_scheduler
from epd_engine.profiler.sim_scheduler import EngineScheduler, SimScheduler
from epd_engine.workload.arrivals import ArrivalSpec
from epd_engine.workload.generators import synthesize

# (name, workload, ttft_s, tpot_s): HydraInfer's TextCaps under a tight TTFT, and EPD-Serve's
# mixed VisualWebInstruct (half text-only, 64 tokens out) at its SLOs (2 s / 50 ms, 0.8 s / 30 ms).
SCENARIOS = {
    "textcaps-tight": ("textcaps", 0.3, 0.04),
    "visualwebinstruct-epdserve": ("visualwebinstruct", 2.0, 0.05),
    "visualwebinstruct-strict": ("visualwebinstruct", 0.8, 0.03),  # EPD-Serve's strict setting
}


def _cpu_s() -> float:
    """CPU seconds of this process and its reaped children (the search's worker processes)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _timed(run: Any) -> tuple[Any, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = run()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def _timed_all(run: Any) -> tuple[Any, float, float]:
    """Like ``_timed``, with the workers' CPU counted (they are shut down inside ``run``)."""
    wall, cpu = time.perf_counter(), _cpu_s()
    result = run()
    return result, time.perf_counter() - wall, _cpu_s() - cpu


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


@contextmanager
def engine_scheduler() -> Iterator[None]:
    """The simulator as it was before: the engine's ``Scheduler``, payloads and all."""

    def build(role: Role, budgets: Budgets, capacity: Capacity, *_: Any) -> SimScheduler:
        return build_scheduler(role, budgets, capacity, EngineScheduler)

    simulator.build_scheduler = build  # type: ignore[assignment]
    try:
        yield
    finally:
        simulator.build_scheduler = build_scheduler


def timed_search(
    records: list[TraceRecord], gpus: int, args: argparse.Namespace, before: bool
) -> dict[str, Any]:
    evaluator = Evaluator(records, reference_cost_model(), MIXED_SLO, args.tolerance)
    load = os.getloadavg()[0]
    if before:
        with engine_scheduler():
            result, wall, cpu = _timed_all(
                lambda: bisection_search(evaluator, gpus, num_workers=args.workers)
            )
    else:
        result, wall, cpu = _timed_all(
            lambda: exhaustive_search(
                evaluator, gpus, show_progress=False, num_workers=args.workers
            )
        )
    best = result.best
    return {
        "wall_s": round(wall, 2),
        "cpu_s_with_workers": round(cpu, 2),
        "num_simulations": result.num_simulations,
        "num_pruned": result.num_pruned,
        "num_candidates": result.num_candidates,
        "best": best.candidate.describe() if best else None,
        "goodput_rps": best.goodput_rps if best else 0.0,
        "loadavg_1m_before": round(load, 2),
    }


def run_mixed(args: argparse.Namespace) -> dict[str, Any]:
    """Before / after on seeded mixed traces, then the scaling table (after only)."""
    comparisons = []
    for gpus, num in [(8, 1000), (32, 2000)][: args.mixed_sizes]:
        for seed in range(args.seeds):
            records = mixed_trace(num, seed)
            row: dict[str, Any] = {"gpus": gpus, "num_requests": num, "seed": seed}
            row["after"] = timed_search(records, gpus, args, before=False)
            if not args.skip_before:
                row["before"] = timed_search(records, gpus, args, before=True)
                row["speedup_wall"] = round(row["before"]["wall_s"] / row["after"]["wall_s"], 2)
                row["same_plan"] = row["before"]["best"] == row["after"]["best"]
            comparisons.append(row)
            print(f"mixed {gpus} GPUs x {num} seed {seed}: {json.dumps(row)}", flush=True)
    scaling = []
    for gpus, num in [(8, n) for n in args.scale_requests] + [(g, 1000) for g in args.scale_gpus]:
        row = {
            "gpus": gpus,
            "num_requests": num,
            **timed_search(mixed_trace(num, 0), gpus, args, False),
        }
        scaling.append(row)
        print(f"scaling: {json.dumps(row)}", flush=True)
    fleet = []
    for gpus, num in args.fleet:
        row = {
            "gpus": gpus,
            "num_requests": num,
            **timed_search(mixed_trace(num, 0), gpus, args, False),
        }
        fleet.append(row)
        print(f"fleet: {json.dumps(row)}", flush=True)
    return {
        "workload": MIXED.summary,
        "rate_rps": MIXED_RATE_RPS,
        "slo": {"ttft_s": MIXED_SLO.ttft_s, "tpot_s": MIXED_SLO.tpot_s},
        "goals_s": {"8x1000": 5, "32x2000": 20, "256x10000": 5},
        "comparisons": comparisons,
        "scaling": scaling,
        "fleet": fleet,
    }


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _sizes(text: str) -> list[tuple[int, int]]:
    """``GPUSxREQUESTS,...`` -> [(gpus, requests), ...]."""
    return [(int(g), int(n)) for g, n in (s.split("x") for s in text.split(",") if s.strip())]


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
    parser.add_argument("--mixed", action="store_true", help="issue 19's mixed traces instead")
    parser.add_argument("--seeds", type=int, default=3, help="mixed traces per size")
    parser.add_argument("--mixed-sizes", type=int, default=2, help="1: 8x1000 only; 2: +32x2000")
    parser.add_argument("--skip-before", action="store_true", help="no before/after comparison")
    parser.add_argument("--scale-requests", type=_ints, default=[500, 1000, 2000, 4000, 8000])
    parser.add_argument("--scale-gpus", type=_ints, default=[8, 16, 32, 64, 128])
    parser.add_argument("--fleet", type=_sizes, default=[], help="e.g. 256x10000 (after only)")
    args = parser.parse_args()
    if args.mixed:
        report = {
            "kind": "epd-bench-plan-mixed",
            "version": 1,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "host": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "workers": args.workers,
            **run_mixed(args),
        }
        print(f"results: {write_results(args.out, report)}")
        return
    results = [run_scenario(s.strip(), args) for s in args.scenarios.split(",") if s.strip()]
    report = {
        "kind": "epd-bench-plan",
        "version": 1,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "cost_model": "reference" if not args.cost_model else args.cost_model,
        "scenarios": results,
    }
    print(f"results: {write_results(args.out, report)}")


if __name__ == "__main__":
    main()
