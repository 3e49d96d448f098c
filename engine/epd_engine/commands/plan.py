"""``epdctl plan``: find the best plan (method, instances per pool, budgets) for a GPU budget.

Prints a ranked table of simulated goodput (exhaustive search, pruned by a bound) and, with
``--compare-heuristic``, what HydraInfer's heuristic picks; writes the chosen plan as JSON
(DESIGN.md plan contract).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from epd_engine.cli import UserError
from epd_engine.commands.simulate import add_input_args, link_label, load_inputs


def _methods(text: str | None) -> Any:
    from epd_engine.config import Method

    if not text:
        return tuple(Method)
    try:
        return tuple(Method(part.strip()) for part in text.split(",") if part.strip())
    except ValueError as exc:
        known = ", ".join(m.value for m in Method)
        raise UserError(f"--methods {text!r}: {exc}; known: {known}") from exc


def _tp_sizes(text: str) -> tuple[int, ...]:
    from epd_engine.config import TENSOR_PARALLEL_SIZES

    try:
        sizes = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError as exc:
        raise UserError(f"--tensor-parallel-sizes {text!r}: {exc}") from exc
    known = ", ".join(map(str, TENSOR_PARALLEL_SIZES))
    if not sizes or any(size not in TENSOR_PARALLEL_SIZES for size in sizes):
        raise UserError(f"--tensor-parallel-sizes {text!r}: each one of {known}")
    return sizes


def _plan(args: argparse.Namespace) -> int:
    from epd_engine.profiler.search import (
        format_table,
        plan_from_search,
        search_plans,
        table_rows,
    )

    if args.gpus < 1:
        raise UserError(f"--gpus must be >= 1, got {args.gpus}")
    if not 0 < args.tolerance < 1:
        raise UserError(f"--tolerance must be in (0, 1), got {args.tolerance}")
    tp_sizes = _tp_sizes(args.tensor_parallel_sizes)
    records, cost, slo = load_inputs(args)
    print(f"migrations over {link_label(cost)}")
    try:
        evaluator, exhaustive, heuristic = search_plans(
            records, cost, slo, args.gpus,
            methods=_methods(args.methods), with_heuristic=args.compare_heuristic,
            show_progress=not args.no_progress, rel_tolerance=args.tolerance,
            num_workers=args.workers, tp_sizes=tp_sizes,
        )  # fmt: skip
    except ValueError as exc:  # a size the cost model cannot project
        raise UserError(f"--tensor-parallel-sizes: {exc}") from exc
    rows = table_rows(exhaustive, args.top)
    print(format_table(rows))
    print(
        f"{exhaustive.num_candidates} plans, {exhaustive.num_pruned} pruned by bound, "
        f"{exhaustive.num_simulations} simulations, {exhaustive.elapsed_s:.1f}s"
    )
    gap = None
    if heuristic is not None:
        print("\nHydraInfer heuristic (work-proportional split per method):")
        print(format_table(table_rows(heuristic)))
        best, pick = exhaustive.best, heuristic.best
        if best is not None and best.goodput_rps:
            gap = 1 - ((pick.goodput_rps or 0.0) if pick else 0.0) / best.goodput_rps
            print(f"heuristic leaves {gap:.1%} of the exhaustive goodput on the table")
    plan = plan_from_search(evaluator, exhaustive, heuristic, slo, args.window)
    if plan is None:
        print("no plan meets the SLO on this trace at any rate tried")
        return 1
    print(f"\nchosen: {plan.describe()}  {plan.reason}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(plan.model_dump_json(indent=2) + "\n", encoding="utf-8")
        print(f"plan: {args.out}")
    if args.report:
        report = {
            "kind": "epd-plan-search",
            "version": 1,
            "gpus": args.gpus,
            "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "attainment": slo.attainment},
            "plan": plan.model_dump(mode="json"),
            "exhaustive": {
                "table": table_rows(exhaustive, None),
                "num_candidates": exhaustive.num_candidates,
                "num_pruned": exhaustive.num_pruned,
                "num_simulations": exhaustive.num_simulations,
                "elapsed_s": exhaustive.elapsed_s,
            },
            "heuristic": None
            if heuristic is None
            else {"table": table_rows(heuristic, None), "elapsed_s": heuristic.elapsed_s},
            "heuristic_goodput_gap": gap,
            "cost_model": cost.meta,
            "link": {"backend": cost.transfer_backend, **dataclasses.asdict(cost.migration)},
        }
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"report: {args.report}")
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="search the best plan for a GPU budget by simulated goodput",
        description="Exhaustive search over every method and ratio (pruned by a goodput "
        "bound), scored by simulating the trace; --compare-heuristic also scores "
        "HydraInfer's heuristic beside it.",
    )
    add_input_args(parser)
    parser.add_argument(
        "--gpus", type=int, required=True, help="GPU budget (one per instance and rank)"
    )
    parser.add_argument(
        "--tensor-parallel-sizes",
        default="1",
        help="comma-separated sizes each pool that runs the language model may split its "
        "instances into, e.g. 1,2,4 (each rank one GPU of the budget; the cost model must "
        "record its 'ranks', as the reference does). Default 1",
    )
    parser.add_argument("--methods", help="comma-separated subset, e.g. E+P+D,EP+D (default all)")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.05,
        help="relative goodput precision (the rate grid's step)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="processes checking candidates in parallel (default: up to 2)",
    )
    parser.add_argument(
        "--compare-heuristic",
        action="store_true",
        help="also score HydraInfer's heuristic pick per method and print how far it falls "
        "short (off by default: it took about 11 of 12 s of an 8-GPU, 1,000-request plan)",
    )
    # the default since the comparison became opt-in; still accepted so scripts keep working
    parser.add_argument("--no-heuristic", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--top", type=int, default=20, help="rows of the table to print")
    parser.add_argument("--window", default="", help="label of the trace window (plan.trace)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out", type=Path, help="chosen plan JSON")
    parser.add_argument("--report", type=Path, help="full search report JSON")
    parser.set_defaults(func=_plan)
