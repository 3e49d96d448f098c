"""``epdctl bench-disagg``: per method, migration times and their share of latency, plus the
router hop, on a whole local system (router + pools as processes). JSON + a short table."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epd_engine.bench.results_file import cpu_model, git_commit, write_results
from epd_engine.cli import UserError

if TYPE_CHECKING:
    from epd_engine.bench.disagg_bench import DisaggBenchReport

PACKAGES = ("epd-operator", "torch", "transformers", "httpx", "openai", "fastapi", "uvicorn")


def _methods(text: str) -> tuple[Any, ...]:
    from epd_engine.config import Method

    names = [part.strip() for part in text.split(",") if part.strip()]
    try:
        return tuple(Method(name) for name in names)
    except ValueError as exc:
        known = ", ".join(m.value for m in Method)
        raise UserError(f"--methods: {exc}; known: {known}") from exc


def _ms(value: float) -> str:
    return f"{value * 1000:7.1f}"


def format_table(report: DisaggBenchReport) -> str:
    """Milliseconds; migration share as a percentage of e2e."""
    head = (f"{'method':<7} {'ok':>5} | {'img p50':>7} {'img p90':>7} {'kv p50':>7} {'kv p90':>7}"
            f" {'mig%':>6} | {'ttft50':>7} {'ttft90':>7} {'tpot50':>7} {'tpot90':>7}"
            f" {'e2e50':>7} {'e2e90':>7}")  # fmt: skip
    lines = ["per method (ms; mig% = migration share of router e2e, overall)", head]
    for m in report.methods:
        c, mig = m["client"], m["migration"]
        lines.append(
            f"{m['method']:<7} {c['num_ok']:>2}/{c['num_requests']:<2} | "
            f"{_ms(mig['image']['p50_s'])} {_ms(mig['image']['p90_s'])} "
            f"{_ms(mig['kv']['p50_s'])} {_ms(mig['kv']['p90_s'])} "
            f"{mig['fraction_of_e2e']['overall'] * 100:5.2f}% | "
            f"{_ms(c['ttft']['p50_s'])} {_ms(c['ttft']['p90_s'])} "
            f"{_ms(c['tpot']['p50_s'])} {_ms(c['tpot']['p90_s'])} "
            f"{_ms(c['e2e']['p50_s'])} {_ms(c['e2e']['p90_s'])}"
        )
    for m in report.methods:
        if hop := m.get("router_hop"):
            lines.append(f"router hop ({m['method']}, {hop['num_pairs']} paired requests, ms):")
            for name in ("ttft", "e2e"):
                h = hop[name]
                lines.append(
                    f"  {name:<4} direct p50 {_ms(h['direct']['p50_s'])}  "
                    f"router p50 {_ms(h['router']['p50_s'])}  "
                    f"added p50 {_ms(h['added']['p50_s'])}  p90 {_ms(h['added']['p90_s'])}"
                )
    for m in report.methods:
        if errors := m["client"]["errors"]:
            lines.append(f"{m['method']}: request errors {errors}")
    for method, error in report.failures.items():
        lines.append(f"{method}: FAILED ({error.splitlines()[0] if error else ''})")
    return "\n".join(lines)


def environment_info(command: Sequence[str]) -> dict[str, Any]:
    """Machine, versions, load and the command line, recorded with the figures."""
    import importlib.metadata as md

    def version(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    return {
        "command": " ".join(command),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "loadavg_start": os.getloadavg(),
        "python": platform.python_version(),
        "versions": {name: version(name) for name in PACKAGES},
        "git_commit": git_commit()[0],
    }


def _bench_disagg(args: argparse.Namespace) -> int:
    from epd_engine.bench.disagg_bench import DisaggBenchConfig, run

    if not (args.model / "config.json").exists():
        raise UserError(f"{args.model} is not a checkpoint (no config.json); run `make model`")
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="epd-bench-disagg-"))
    try:
        config = DisaggBenchConfig(
            model_dir=args.model.resolve(), run_dir=run_dir.resolve(),
            model_name=args.model.name, methods=_methods(args.methods),
            num_requests=args.num_requests, max_concurrency=args.max_concurrency,
            max_tokens=args.max_tokens, seed=args.seed, router_hop=not args.no_router_hop,
            max_run_s=args.max_run_time, kv_handoff=args.kv_handoff,
        )  # fmt: skip
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    environment = environment_info(["epdctl", *sys.argv[1:]])
    print(f"bench-disagg: logs under {run_dir}; load average {environment['loadavg_start']}")
    started = time.monotonic()
    report = run(config, environment, log=lambda line: print(line, flush=True))
    environment["loadavg_end"] = os.getloadavg()
    environment["wall_s"] = round(time.monotonic() - started, 1)
    print(format_table(report))
    if args.out:
        write_results(args.out, report.to_dict(), command=environment["command"])
        print(f"results: {args.out}")
    return 1 if report.failures else 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench-disagg",
        help="per method: migration times, their share of latency, and the router hop",
        description="Starts router + pools for each method, drives a mixed text/image workload "
        "(greedy, ignore_eos, fixed max_tokens) and reports migration p50/p90 (image E→P, "
        "KV P→D), the share of e2e latency spent migrating, TTFT/TPOT/e2e, and the latency "
        "the router hop adds (EPD behind the router vs a standalone EPD instance).",
    )
    parser.add_argument("--model", required=True, type=Path, help="checkpoint directory")
    parser.add_argument("--out", type=Path, help="JSON results file")
    parser.add_argument("--num-requests", type=int, default=48, help="per method (default 48)")
    parser.add_argument(
        "--methods", default="E+P+D,EP+D,ED+P,E+PD,EPD", help="comma-separated (default: all)"
    )
    parser.add_argument("--max-concurrency", type=int, default=4, help="in flight (default 4)")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument(
        "--max-run-time", type=float, default=120.0,
        help="seconds one run may take; requests still open then count as errors (default 120)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-handoff", choices=("early", "after-prefill"), default="early",
        help="when KV is offered to the decode instance (the engines' --kv-handoff)",
    )  # fmt: skip
    parser.add_argument("--no-router-hop", action="store_true", help="skip the router-hop run")
    parser.add_argument("--run-dir", type=Path, help="process logs (default: a temp folder)")
    parser.set_defaults(func=_bench_disagg)
