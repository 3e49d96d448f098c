"""``epdctl simulate``: replay a trace on a plan in the discrete-event simulator.

Reports the same summary, attainment and goodput as ``epdctl bench`` (same JSON shape), for
any plan and any GPU count, from a cost model (``epdctl profile-costs``, or ``reference``).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

from epd_engine.cli import UserError
from epd_engine.commands.trace import add_workload_args, generate_from_args, load_trace
from epd_engine.transfer import TRANSFER_BACKENDS

_POOL = re.compile(r"(\d+)(EPD|EP|ED|PD|E|P|D)")


def add_input_args(parser: argparse.ArgumentParser) -> None:
    """Trace, cost model and SLO flags shared by ``simulate`` and ``plan``."""
    parser.add_argument("--trace", help="JSONL trace (DESIGN.md §4 format)")
    add_workload_args(parser, required=False)
    parser.add_argument(
        "--cost-model",
        default="reference",
        help="cost model JSON from `epdctl profile-costs`, or 'reference' (synthetic "
        "LLaVA-1.5-7B on an H800-class GPU; default), 'reference:qwen3-vl-8b' or "
        "'reference:gemma3-4b'",
    )
    parser.add_argument(
        "--transfer-backend",
        default="auto",
        choices=TRANSFER_BACKENDS,
        help="the deployment's migration backend: its link as profile-costs measured it "
        "(default auto: shm, as `epdctl up` on one host uses; tcp for separate hosts). A cost "
        "model without that backend's measurement keeps its stored link",
    )
    slo = parser.add_argument_group("SLO (defaults: HydraInfer v2, LLaVA-1.5-7B)")
    slo.add_argument("--slo-ttft", type=float, default=4.0, help="TTFT SLO, s (default 4)")
    slo.add_argument("--slo-tpot", type=float, default=0.08, help="TPOT SLO, s (default 0.08)")
    slo.add_argument("--attainment", type=float, default=0.9, help="goodput target (default 0.9)")


def load_inputs(args: argparse.Namespace) -> tuple[list[Any], Any, Any]:
    """(records, cost model, SLO) from the shared flags; UserError on any bad input."""
    from epd_engine.config import SLO
    from epd_engine.profiler.reference import named_cost_model
    from epd_engine.workload.arrivals import at_rate

    if args.trace and args.workload:
        raise UserError("use either --trace or --workload, not both")
    if args.trace:
        records = load_trace(args.trace)
        if args.rate is not None:
            if args.rate <= 0:
                raise UserError(f"--rate must be > 0, got {args.rate}")
            records = at_rate(records, args.rate)
    elif args.workload:
        records = generate_from_args(args)
    else:
        raise UserError("give a trace (--trace FILE) or a workload (--workload NAME --rate R)")
    try:
        cost = named_cost_model(args.cost_model).for_backend(args.transfer_backend)
        slo = SLO(ttft_s=args.slo_ttft, tpot_s=args.slo_tpot, attainment=args.attainment)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    return records, cost, slo


def link_label(cost: Any) -> str:
    """Which link the simulated migrations use, e.g. ``shm (40 us + 5.1 GB/s)``."""
    m = cost.migration
    name = cost.transfer_backend or "as stored in the cost model"
    return f"{name} ({m.latency_s * 1e6:.0f} us + {m.bytes_per_s / 1e9:.2f} GB/s)"


def parse_pools(text: str) -> Any:
    """``1E3P4D`` (or ``E=1,P=3,D=4``) -> Plan; the method follows from the roles."""
    from epd_engine.config import Method, Role
    from epd_engine.contracts.plan import Plan

    compact = text.replace(" ", "")
    if "=" in compact:
        pairs = [part.split("=", 1) for part in compact.split(",") if part]
        compact = "".join(f"{count}{role}" for role, count in pairs)
    matches = list(_POOL.finditer(compact))
    if not matches or "".join(m.group(0) for m in matches) != compact:
        raise UserError(f"--pools {text!r}: expected e.g. 1E3P4D or E=1,P=3,D=4")
    pools = {Role(m.group(2)): int(m.group(1)) for m in matches}
    roles = set(pools)
    method = next((m for m in Method if set(m.roles) == roles), None)
    if method is None:
        names = ", ".join(sorted(r.value for r in roles))
        raise UserError(f"--pools {text!r}: roles {names} do not form a method")
    try:
        return Plan(method=method, pools=pools)
    except ValueError as exc:
        raise UserError(f"--pools {text!r}: {exc}") from exc


def _load_plan(args: argparse.Namespace) -> Any:
    from pydantic import ValidationError

    from epd_engine.contracts.plan import Plan

    if bool(args.plan) == bool(args.pools):
        raise UserError("give exactly one of --plan PLAN.json or --pools 1E3P4D")
    if args.pools:
        return parse_pools(args.pools)
    try:
        return Plan.model_validate_json(Path(args.plan).read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError(f"{args.plan}: cannot read plan ({exc.strerror or exc})") from exc
    except ValidationError as exc:
        raise UserError(f"{args.plan}: not a valid plan ({exc.errors()[0]['msg']})") from exc


def _simulate(args: argparse.Namespace) -> int:
    from epd_engine.bench.report import build_report, write_report
    from epd_engine.contracts.trace import mean_rate_rps, summarize_trace
    from epd_engine.profiler.candidates import Candidate
    from epd_engine.profiler.evaluate import Evaluator
    from epd_engine.profiler.simulator import Simulator
    from epd_engine.slo.goodput import find_goodput
    from epd_engine.slo.outcomes import summarize
    from epd_engine.workload.arrivals import at_rate

    records, cost, slo = load_inputs(args)
    plan = _load_plan(args)
    simulator = Simulator(plan, cost, slo)
    if simulator.infeasible:
        raise UserError(f"no batch budget of {plan.describe()} meets the SLO on this cost model")
    search = None
    if args.goodput:
        runs: dict[float, Any] = {}

        def run(rate: float) -> Any:
            runs[rate] = simulator.run(at_rate(records, rate)).results
            return runs[rate]

        # Never above what the plan sustains (see profiler.bounds: burst absorption).
        candidate = Candidate(plan.method, tuple(plan.pools[r] for r in plan.method.roles))
        capacity = Evaluator(records, cost, slo).bound(candidate)
        capacity = capacity if 0 < capacity < float("inf") else 1e6
        start = min(args.goodput_start or mean_rate_rps(records) or 1.0, capacity)
        search = find_goodput(
            run, slo, start_rps=start, min_rps=min(start, 0.01), max_rps=capacity,
            rel_tolerance=args.goodput_tolerance,
        )  # fmt: skip
        rate = search.goodput_rps or min(runs)
        results = runs[rate]
        print(f"goodput {search.goodput_rps:.3f} req/s (simulated); details at {rate:.3f} req/s")
    else:
        single = simulator.run(records)
        results = single.results
        for role in sorted(single.prefix_queried_tokens):  # a trace with hash_ids: modelled
            if (hit_rate := single.prefix_hit_rate(role)) is not None:
                print(f"prefix cache {role}: {hit_rate:.1%} of prompt tokens hit (modelled)")
    summary = summarize(results, slo)
    budgets = {r.value: b.model_dump() for r, b in simulator.budgets.items()}
    print(f"plan {plan.describe()}  budgets {budgets}  link {link_label(cost)}")
    print(
        f"requests {summary.num_ok}/{summary.num_requests} ok  attainment {summary.attainment:.1%}"
        f"  TTFT p50/p90/p99 {summary.ttft.p50_s:.3f}/{summary.ttft.p90_s:.3f}/"
        f"{summary.ttft.p99_s:.3f}s  TPOT(p90 per request) p50/p90 "
        f"{summary.tpot_p90.p50_s * 1e3:.1f}/{summary.tpot_p90.p90_s * 1e3:.1f}ms"
    )
    if args.out:
        report = build_report(
            label=args.label or f"sim {plan.describe()}", slo=slo,
            trace=summarize_trace(records), summary=summary, results=results, search=search,
            mode="goodput" if args.goodput else "single", endpoint="simulator",
            model=str(cost.meta.get("model", {}).get("name", "")),
            extra={"plan": plan.model_dump(mode="json"), "budgets": budgets, "simulated": True,
                   "link": {"backend": cost.transfer_backend, **asdict(cost.migration)}},
        )  # fmt: skip
        print(f"results: {write_report(report, args.out)}")
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="simulate a plan on a trace (same metrics as bench)",
        description="Discrete-event simulation driving the real scheduler and routing policy "
        "with a cost model; prints bench's summary and writes bench's JSON.",
    )
    add_input_args(parser)
    parser.add_argument("--plan", help="plan JSON (from `epdctl plan`)")
    parser.add_argument("--pools", help="instances per pool, e.g. 1E3P4D or EP=3,D=5")
    parser.add_argument("--goodput", action="store_true", help="find goodput by bisection")
    parser.add_argument("--goodput-start", type=float, help="first rate (default: trace rate)")
    parser.add_argument("--goodput-tolerance", type=float, default=0.05, help="relative")
    parser.add_argument("--label", help="name of this run in the report")
    parser.add_argument("--out", type=Path, help="JSON results file (epdctl bench format)")
    parser.set_defaults(func=_simulate)
