"""``epdctl bench-engine``: prefill/decode/encode throughput of the engine vs transformers."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from epd_engine.cli import UserError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench-engine",
        help="engine throughput (prefill, decode, encode) vs transformers generate (JSON)",
        description=(
            "Runs the engine in-process on CPU: prefill tokens/s, decode tokens/s at several "
            "batch sizes, encode images/s, each next to transformers' "
            "LlavaForConditionalGeneration on the same files, same batch and the same torch "
            "thread count. Prints the JSON and writes it to --out."
        ),
    )
    parser.add_argument("--model", required=True, type=Path, help="checkpoint directory")
    parser.add_argument("--out", type=Path, help="JSON file to write (default: print only)")
    parser.add_argument(
        "--repeats", type=int, help="interleaved rounds, best kept (default 5; 1 with --quick)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="small sizes, one round: a smoke test, not figures"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads for both sides (default 1)"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not (args.model / "config.json").is_file():
        raise UserError(
            f"{args.model}: no config.json (make one with `epdctl make-model --preset tiny-llava`)"
        )
    from dataclasses import replace

    from epd_engine.bench.engine_bench import EngineBenchConfig, run_engine_bench
    from epd_engine.bench.results_file import write_results
    from epd_engine.model.model_config import ModelFormatError

    try:
        base = EngineBenchConfig.quick(args.model) if args.quick else EngineBenchConfig(args.model)
        repeats = base.repeats if args.repeats is None else args.repeats
        config = replace(base, repeats=repeats, cpu_threads=args.threads)
        result = run_engine_bench(config, _command(args, config.repeats), progress=_progress)
    except (ModelFormatError, ValueError) as exc:
        raise UserError(str(exc)) from exc
    print(json.dumps(result, indent=2))
    if args.out:
        write_results(args.out, result, command=result["command"])
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _command(args: argparse.Namespace, repeats: int) -> str:
    """The invocation, rebuilt from the parsed flags (the same whether run via make or not)."""
    words = ["epdctl", "bench-engine", "--model", str(args.model)]
    words += ["--out", str(args.out)] if args.out else []
    words += ["--repeats", str(repeats), "--threads", str(args.threads)]
    words += ["--quick"] if args.quick else []
    return shlex.join(words)


def _progress(message: str) -> None:
    print(f"bench-engine: {message}", file=sys.stderr, flush=True)
