"""Simulator fidelity benchmark (``make bench-fidelity``): the real system vs the simulator.

For each method (default E+P+D, EPD, EP+D; manifests ``examples/tiny-*.yaml``, tiny model on
CPU) it starts the real system with ``epdctl up --detach``, replays one trace at a few rates
with ``epdctl bench --sweep``, stops it with ``epdctl down``, then simulates the same trace
at the same rates with a cost model profiled on this machine (``epdctl profile-costs``) and
the same plan, budgets and cache sizes. The first method's real run also calibrates the
cost model's overheads (router, HTTP, engine loop, migration hand-off and pull, host jitter:
``profiler.calibrate``); the other methods are held out. E+P+D calibrates by default: it is
the one run in which every overhead is observable (an image and a KV migration per request);
EPD has no migration at all. It reports, per method and rate, the relative error of p90 TTFT
and p90 TPOT (per-request p90 gap, the SLO quantity), the mean seconds per stage real vs
simulated (where the error comes from), and whether the goodput ranking of the methods
agrees. Vidur's class is < 10% latency error; we report what we get.

``--workload multiturn`` replays conversations instead (``workload/conversations.py``:
sessions of 2-4 turns, some with images; the engines' prefix cache on, as by default), so
the simulator's prefix and answer-page model meets the real caches; each point then also
holds the prompt tokens the caches served, real (usage ``cached_tokens``) and simulated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

from epd_engine.bench.report import (
    build_report,
    load_report,
    results_by_rate,
    results_from_report,
    write_report,
)
from epd_engine.bench.results_file import write_results
from epd_engine.bench.sweep_merge import merge_sweeps
from epd_engine.config import SLO, Stage
from epd_engine.contracts.plan import Budgets, Plan
from epd_engine.contracts.trace import read_trace, summarize_trace, write_trace
from epd_engine.profiler.calibrate import calibrate
from epd_engine.profiler.cost_model import FittedCostModel, load_cost_model, save_cost_model
from epd_engine.profiler.simulator import cpu_share, simulate
from epd_engine.slo.goodput import sweep
from epd_engine.slo.outcomes import LatencyStats, RequestResult
from epd_engine.workload import conversations
from epd_engine.workload.arrivals import at_rate

MANIFESTS = {
    "E+P+D": "examples/tiny-e-p-d.yaml",
    "EP+D": "examples/tiny-ep-d.yaml",
    "ED+P": "examples/tiny-ed-p.yaml",
    "E+PD": "examples/tiny-e-pd.yaml",
    "EPD": "examples/tiny-epd.yaml",
}
EPDCTL = [sys.executable, "-m", "epd_engine"]


def sh(*args: str, timeout: float = 1800) -> None:
    print("$", " ".join(args[2:] if args[:3] == tuple(EPDCTL) else args), flush=True)
    subprocess.run(list(args), check=True, timeout=timeout)


def _flag(extra_args: list[str], name: str) -> int | None:
    return int(extra_args[extra_args.index(name) + 1]) if name in extra_args else None


def manifest_plan(path: str, cost: FittedCostModel) -> tuple[str, Plan, FittedCostModel]:
    """(deployment name, plan with the manifest's budgets, cost model with its cache sizes and
    the link of its transfer backend: `epdctl up` runs every instance on this host)."""
    from epd_operator.api.spec import EPDDeployment, fixed_plan

    deployment = EPDDeployment.from_yaml(path)
    spec = deployment.spec
    plan = fixed_plan(spec)
    tokens = _flag(spec.engine.extra_args, "--token-budget")
    images = _flag(spec.engine.extra_args, "--image-budget")
    if tokens and images:
        budgets = {r: Budgets(image_budget=images, token_budget=tokens) for r in plan.pools}
        plan = plan.model_copy(update={"budgets": budgets})
    capacity = dataclasses.replace(
        cost.capacity,
        num_kv_blocks=spec.engine.num_kv_blocks,
        num_image_blocks=spec.engine.num_image_blocks,
    )
    cost = dataclasses.replace(cost, capacity=capacity)
    return deployment.name, plan, cost.for_backend(spec.engine.transfer_backend)


def p90s(report: dict[str, Any]) -> dict[float, dict[str, Any]]:
    out = {}
    for point in report["points"]:
        summary = point["summary"] or {}
        out[float(point["rate_rps"])] = {
            "ttft_p90_s": summary.get("ttft", {}).get("p90_s", 0.0),
            "tpot_p90_s": summary.get("tpot_p90", {}).get("p90_s", 0.0),
            "attainment": point["attainment"],
            "stage_mean_s": summary.get("stage_mean_s") or {},
        }
    return out


def rel_error(sim: float, real: float) -> float | None:
    return abs(sim - real) / real if real > 0 else None


def p90_pair(results: list[RequestResult]) -> tuple[float, float]:
    """(p90 TTFT, p90 of the per-request p90 gap) as the reports compute them."""
    ok = [r for r in results if r.ok]
    ttft = LatencyStats.of([r.ttft_s for r in ok if r.ttft_s is not None]).p90_s
    return ttft, LatencyStats.of([r.tpot_p90_s for r in ok if r.itl_s]).p90_s


def bootstrap_p90(results: list[RequestResult], draws: int = 1000) -> dict[str, list[float]]:
    """80% interval of the real p90s as resampling the run's requests moves them: how far
    40 requests pin a p90 down (a 10% error is below the noise where this is wider)."""
    rng = random.Random(0)
    pairs = sorted(p90_pair(rng.choices(results, k=len(results))) for _ in range(draws))
    ttft = sorted(t for t, _ in pairs)
    tpot = sorted(p for _, p in pairs)
    lo, hi = int(0.1 * draws), int(0.9 * draws)
    return {"ttft_p90_s": [ttft[lo], ttft[hi]], "tpot_p90_s": [tpot[lo], tpot[hi]]}


def run_real(
    name: str, manifest: str, args: argparse.Namespace, out: Path, rates: str | None = None
) -> dict[str, Any]:
    if args.reuse_real and out.exists():
        print(f"reusing {out}")
        return load_report(out)
    sh(*EPDCTL, "up", "-f", manifest, "--port", str(args.port), "--detach",
       "--runs-dir", str(args.runs_dir), "--model-dir", str(args.model_dir))  # fmt: skip
    # Warm-up sends the trace's first turns: their pages would then be cached before the
    # run, which the simulator does not see (``--workload multiturn`` warms up with none).
    warmup = "0" if args.workload == conversations.NAME else "2"
    try:
        sh(*EPDCTL, "bench", "--endpoint", f"http://127.0.0.1:{args.port}/v1",
           "--trace", str(args.trace_path), "--sweep", rates or args.rates, "--no-progress",
           "--warmup", warmup,  # first kernels and connections: not what a request costs
           "--tokenizer", str(args.model_dir),  # token-exact prompts, as the simulator counts
           "--slo-ttft", str(args.slo_ttft), "--slo-tpot", str(args.slo_tpot),
           "--label", name, "--out", str(out))  # fmt: skip
    finally:
        subprocess.run([*EPDCTL, "down", name, "--runs-dir", str(args.runs_dir)], check=False)
    return load_report(out)


def run_interleaved(methods: list[str], args: argparse.Namespace) -> None:
    """Every method at one rate before the next rate (``--interleave``), then one sweep
    report per method merged from its single-rate ones (``sweep_merge.py``)."""
    slugs = [m.replace("+", "-").lower() for m in methods]
    if args.reuse_real and all((args.results / f"real-{s}.json").exists() for s in slugs):
        return  # merged before
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    parts: dict[str, list[Path]] = {m: [] for m in methods}
    for rate in rates:
        for method in methods:
            slug = method.replace("+", "-").lower()
            out = args.results / f"real-{slug}-at-{rate}.json"
            name, _, _ = manifest_plan(MANIFESTS[method], load_cost_model(args.cost_path))
            run_real(name, MANIFESTS[method], args, out, rates=rate)
            parts[method].append(out)
    for method, paths in parts.items():
        slug = method.replace("+", "-").lower()
        merged = merge_sweeps([load_report(p) for p in paths])
        write_report(merged, args.results / f"real-{slug}.json")


def prefill_hits(plan: Plan, hit_tokens: dict[str, int]) -> int:
    """Prompt tokens the prefill pools' prefix caches served (a decode pool's count is the
    pages it need not pull, not usage ``cached_tokens``)."""
    return sum(
        hit_tokens.get(role.value, 0) for role in plan.method.roles if role.runs(Stage.PREFILL)
    )


def real_cached_tokens(results: list[RequestResult]) -> int:
    return sum(r.server_cached_tokens or 0 for r in results if r.ok)


def run_sim(plan: Plan, cost: FittedCostModel, args: argparse.Namespace, out: Path) -> dict:
    records = read_trace(args.trace_path)
    slo = SLO(ttft_s=args.slo_ttft, tpot_s=args.slo_tpot)
    rates = [float(r) for r in args.rates.split(",")]
    cores = args.host_cores or None

    hits: dict[str, int] = {}  # rate -> prompt tokens the prefill pools' caches served

    def run(rate: float, seed: int = 0) -> list[RequestResult]:
        result = simulate(plan, at_rate(records, rate), cost, slo, host_cores=cores, seed=seed)
        if seed == 0:
            hits[f"{rate:g}"] = prefill_hits(plan, result.prefix_hit_tokens)
        return result.results

    search = sweep(run, rates, slo)
    # A p90 of 40 simulated requests moves with the jitter's draws as much as a real one with
    # the host's: the errors use the median over seeds (the planner simulates long windows).
    seeds = {
        f"{rate:g}": [p90_pair(run(rate, seed)) for seed in range(args.sim_seeds)] for rate in rates
    }
    report = build_report(
        label=f"sim {plan.describe()}", slo=slo, trace=summarize_trace(records), summary=None,
        search=search, mode="sweep", endpoint="simulator",
        extra={"plan": plan.model_dump(mode="json"), "p90_by_seed": seeds,
               "cached_tokens_by_rate": hits},
    )  # fmt: skip
    write_report(report, out)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # E+P+D calibrates: its run shows every overhead, migrations included (docs/planning.md)
    parser.add_argument("--methods", default="E+P+D,EPD,EP+D", help="the first calibrates")
    parser.add_argument(
        "--workload",
        default="textcaps",
        help=f"a generator's shape, or {conversations.NAME!r}: sessions of 2-4 turns",
    )
    parser.add_argument(
        "--trace-args",
        default="",
        help="more `epdctl trace generate` flags (random-mm's shape: '--images-per-request 2')",
    )
    parser.add_argument("--num", type=int, default=40)
    parser.add_argument("--rates", default="1,2,4", help="sweep rates, req/s")
    parser.add_argument("--slo-ttft", type=float, default=1.0)
    parser.add_argument("--slo-tpot", type=float, default=0.1)
    parser.add_argument("--port", type=int, default=8093)
    parser.add_argument("--model-dir", type=Path, default=Path("models/tiny-llava"))
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/fidelity"))
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results/fidelity"))
    parser.add_argument("--cost-model", type=Path, help="reuse this cost model (else profile)")
    parser.add_argument("--no-calibrate", action="store_true", help="runner costs only")
    parser.add_argument(
        "--calibrate-rates",
        choices=["all", "lowest"],
        default="lowest",
        help="calibrate on every rate of the sweep, or only its lowest (unloaded) one",
    )
    parser.add_argument("--reuse-real", action="store_true", help="keep existing real reports")
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="measure every method at a rate before the next rate (the host's drift then "
        "falls between rates, not between the calibrating and the held-out methods)",
    )
    parser.add_argument("--sim-seeds", type=int, default=9, help="jitter seeds a point simulates")
    parser.add_argument(
        "--host-cores",
        type=float,
        default=float(os.cpu_count() or 1),
        help="cores the local instances share (0: each instance has its own device)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/fidelity-cpu.json"))
    args = parser.parse_args()
    args.results.mkdir(parents=True, exist_ok=True)
    if not (args.model_dir / "config.json").exists():
        sh(*EPDCTL, "make-model", "--preset", "tiny-llava", str(args.model_dir))
    cost_path = args.cost_model or args.results / "cost-model.json"
    if args.cost_model is None:
        sh(*EPDCTL, "profile-costs", "--model", str(args.model_dir), "--out", str(cost_path),
           "--num-kv-blocks", "256", "--num-image-blocks", "16", "--no-progress")  # fmt: skip
    cost = load_cost_model(cost_path)
    args.cost_path = cost_path
    args.trace_path = args.results / "trace.jsonl"
    if args.workload == conversations.NAME:
        write_trace(conversations.conversations(args.num, seed=0), args.trace_path)
        # a fresh system per rate: a sweep replays the same conversations at every rate, and
        # the pages one rate left cached would serve the next (each simulation starts empty)
        args.interleave = True
    else:
        sh(*EPDCTL, "trace", "generate", "--workload", args.workload, "--num", str(args.num),
           "--rate", "1", "--seed", "0", *shlex.split(args.trace_args),
           "-o", str(args.trace_path))  # fmt: skip

    rows = []
    started = time.perf_counter()
    calibrated_on = None
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.interleave:
        run_interleaved(methods, args)
        args.reuse_real = True  # the merged reports
    for method in methods:
        name, plan, _ = manifest_plan(MANIFESTS[method], cost)
        slug = method.replace("+", "-").lower()
        real = run_real(name, MANIFESTS[method], args, args.results / f"real-{slug}.json")
        if calibrated_on is None and not args.no_calibrate:
            calibrated_on = method
            # Overheads are unloaded costs: by default only the sweep's lowest rate calibrates,
            # and queueing under load is left to the simulator (calibrating on loaded rates
            # counted that queueing twice: p90 TTFT error 82% vs 31% on a 2-12 req/s sweep).
            # A report from before requests_by_rate has only its goodput rate's requests.
            every_rate = results_by_rate(real)
            if args.calibrate_rates == "lowest" and every_rate:
                every_rate = {min(every_rate): every_rate[min(every_rate)]}
            results = [r for rs in every_rate.values() for r in rs] or results_from_report(real)
            rates = ",".join(f"{r:g}" for r in every_rate)
            share = cpu_share(plan, args.host_cores or None)
            source = f"real {method} run ({f'rates {rates}' if rates else 'goodput rate only'})"
            cost = calibrate(cost, results, source=source, cpu_share=share)
            save_cost_model(cost, args.results / "cost-model-calibrated.json")
        _, plan, plan_cost = manifest_plan(MANIFESTS[method], cost)
        sim = run_sim(plan, plan_cost, args, args.results / f"sim-{slug}.json")
        real_p, sim_p = p90s(real), p90s(sim)
        real_results = results_by_rate(real)
        points = []
        for rate, r in sorted(real_p.items()):
            s: dict[str, Any] = dict(sim_p.get(rate, {}))
            by_seed = sim["p90_by_seed"].get(f"{rate:g}", [])
            if by_seed:  # the median over seeds; seed 0's report keeps the stage means
                s["ttft_p90_s"] = median(t for t, _ in by_seed)
                s["tpot_p90_s"] = median(p for _, p in by_seed)
                s["ttft_p90_s_by_seed"] = [t for t, _ in by_seed]
                s["tpot_p90_s_by_seed"] = [p for _, p in by_seed]
            if rate in real_results:
                r = {
                    **r,
                    "p90_80pct_interval": bootstrap_p90(real_results[rate]),
                    "cached_tokens": real_cached_tokens(real_results[rate]),
                }
            s["cached_tokens"] = sim.get("cached_tokens_by_rate", {}).get(f"{rate:g}")
            points.append({
                "rate_rps": rate, "real": r, "sim": s,
                "ttft_p90_rel_error": rel_error(s.get("ttft_p90_s", 0.0), r["ttft_p90_s"]),
                "tpot_p90_rel_error": rel_error(s.get("tpot_p90_s", 0.0), r["tpot_p90_s"]),
            })  # fmt: skip
        rows.append({
            "method": method, "plan": plan.describe(), "calibration_run": method == calibrated_on,
            "real_created_at": real.get("created_at"),
            "budgets": {r.value: b.model_dump() for r, b in plan.budgets.items()},
            "goodput_real_rps": real["goodput_rps"], "goodput_sim_rps": sim["goodput_rps"],
            "points": points,
        })  # fmt: skip

    def errors(key: str, held_out: bool = False) -> list[float]:
        return [
            p[key]
            for row in rows
            if not (held_out and row["calibration_run"])
            for p in row["points"]
            if p[key] is not None
        ]

    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    def rank(key: str) -> list[str]:
        return [r["method"] for r in sorted(rows, key=lambda r: -(r[key] or 0.0))]

    def sign(x: float) -> int:
        return (x > 1e-9) - (x < -1e-9)

    pairs = [(a, b) for i, a in enumerate(rows) for b in rows[i + 1 :]]
    concordant = sum(
        sign((a["goodput_real_rps"] or 0) - (b["goodput_real_rps"] or 0))
        == sign((a["goodput_sim_rps"] or 0) - (b["goodput_sim_rps"] or 0))
        for a, b in pairs
    )

    ttft_err, tpot_err = errors("ttft_p90_rel_error"), errors("tpot_p90_rel_error")
    report = {
        "kind": "epd-bench-fidelity",
        "version": 1,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "workload": args.workload, "trace_args": args.trace_args,
        "num_requests": args.num, "rates_rps": args.rates,
        "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
        "cost_model": {"path": str(cost_path), **cost.meta.get("fit", {})},
        "loadavg": os.getloadavg(),  # now; with --reuse-real the real runs are older
        "real_runs_reused": bool(args.reuse_real),
        "sim_seeds": args.sim_seeds,
        "methods": rows,
        "calibrated_on": calibrated_on,
        "overheads": dataclasses.asdict(cost.overheads),
        "ttft_p90_mean_rel_error": mean(ttft_err),
        "tpot_p90_mean_rel_error": mean(tpot_err),
        "ttft_p90_mean_rel_error_held_out": mean(errors("ttft_p90_rel_error", True)),
        "tpot_p90_mean_rel_error_held_out": mean(errors("tpot_p90_rel_error", True)),
        "goodput_rank_real": rank("goodput_real_rps"),
        "goodput_rank_sim": rank("goodput_sim_rps"),
        "elapsed_s": round(time.perf_counter() - started, 1),
    }  # fmt: skip
    # Pairwise, ties included: a tie on one side and an order on the other is a disagreement.
    report["goodput_pairs_agreeing"] = f"{concordant}/{len(pairs)}"
    report["goodput_ranking_agrees"] = concordant == len(pairs)
    report["host_cores"] = args.host_cores
    write_results(args.out, report)
    print(json.dumps({k: v for k, v in report.items() if k != "methods"}, indent=2))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
