"""``epdctl trace``: generate, inspect, rescale and window request traces (DESIGN.md §4)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from epd_engine.cli import UserError


def add_workload_args(parser: argparse.ArgumentParser, *, required: bool) -> None:
    """Flags shared with ``epdctl bench`` for generating a trace on the fly."""
    parser.add_argument("--workload", required=required, help="generator name (trace workloads)")
    parser.add_argument("--num", type=int, default=200, help="number of requests (default 200)")
    parser.add_argument("--rate", type=float, help="mean arrival rate, req/s")
    parser.add_argument(
        "--arrival",
        choices=("poisson", "gamma", "uniform"),
        default="poisson",
        help="arrival process (default poisson)",
    )
    parser.add_argument("--cv", type=float, default=2.0, help="gamma inter-arrival CV (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--model-family",
        default="llava-1.5",
        help="visual tokens per image: llava-1.5, llava-next, qwen2-vl, qwen3-vl, gemma3",
    )
    parser.add_argument(
        "--text-only-fraction", type=float, help="override the share of text-only requests"
    )
    mm = parser.add_argument_group("random-mm (vLLM style) options")
    mm.add_argument("--input-len", type=int, help="text tokens per request (default 400)")
    mm.add_argument("--output-len", type=int, help="output tokens per request (default 150)")
    mm.add_argument("--range-ratio", type=float, help="lengths uniform within ±ratio")
    mm.add_argument("--images-per-request", type=int, help="base images per request (default 1)")
    mm.add_argument("--images-range-ratio", type=float, help="image count within ±ratio")
    mm.add_argument("--image-size", action="append", metavar="WxH", help="repeatable; 640x640")


_MM_FLAGS = ("input_len", "output_len", "range_ratio", "images_per_request",
             "images_range_ratio", "image_size")  # fmt: skip


def _shape_from_args(args: argparse.Namespace) -> Any:
    """The workload name, or a random-mm shape built from its flags."""
    from epd_engine.workload.generators import random_mm

    given = {name: getattr(args, name) for name in _MM_FLAGS if getattr(args, name) is not None}
    if not given:
        return args.workload
    if args.workload != "random-mm":
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise UserError(f"{flags} only apply to --workload random-mm")
    sizes = []
    for text in args.image_size or ["640x640"]:
        try:
            width, height = (int(v) for v in text.lower().split("x"))
        except ValueError as exc:
            raise UserError(f"--image-size expects WxH, e.g. 640x640, got {text!r}") from exc
        sizes.append((width, height))
    return random_mm(
        input_len=args.input_len or 400,
        output_len=args.output_len or 150,
        range_ratio=args.range_ratio or 0.0,
        base_items_per_request=1 if args.images_per_request is None else args.images_per_request,
        num_items_range_ratio=args.images_range_ratio or 0.0,
        image_sizes=sizes,
    )


def add_format_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--format",
        choices=("auto", "epd", "mooncake", "burstgpt", "azure"),
        default="auto",
        help="trace file format (default: detected from the first line)",
    )


def generate_from_args(args: argparse.Namespace) -> list[Any]:
    """Build a trace from the workload flags; UserError on bad values."""
    from epd_engine.workload.arrivals import ArrivalSpec
    from epd_engine.workload.generators import synthesize

    if args.rate is None:
        raise UserError("--rate is required with --workload")
    if args.num < 1:
        raise UserError(f"--num must be >= 1, got {args.num}")
    try:
        arrivals = ArrivalSpec(args.arrival, args.rate, args.cv)
        return synthesize(
            _shape_from_args(args),
            args.num,
            arrivals,
            seed=args.seed,
            image_tokenizer=args.model_family,
            text_only_fraction=args.text_only_fraction,
        )
    except ValueError as exc:
        raise UserError(str(exc)) from exc


def load_trace(path: str, fmt: str = "auto") -> list[Any]:
    """A trace in any supported format (``trace_formats.FORMATS``), or a clear error."""
    from epd_engine.contracts.trace import TraceFormatError
    from epd_engine.workload.trace_formats import read_any

    try:
        records = read_any(path, fmt)
    except TraceFormatError as exc:
        raise UserError(str(exc)) from exc
    if not records:
        raise UserError(f"{path}: trace has no requests")
    return records


def _generate(args: argparse.Namespace) -> int:
    from epd_engine.contracts.trace import summarize_trace, write_trace

    records = generate_from_args(args)
    write_trace(records, args.output)
    print(f"wrote {len(records)} requests to {args.output}: {json.dumps(summarize_trace(records))}")
    return 0


def _show(args: argparse.Namespace) -> int:
    from epd_engine.contracts.trace import summarize_trace

    summary = summarize_trace(load_trace(args.trace, args.format))
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        width = max(len(k) for k in summary)
        for key, value in summary.items():
            print(f"{key:<{width}}  {value}")
    return 0


def _scale(args: argparse.Namespace) -> int:
    from epd_engine.contracts.trace import write_trace
    from epd_engine.workload.arrivals import at_rate

    if args.rate <= 0:
        raise UserError(f"--rate must be > 0, got {args.rate}")
    records = at_rate(load_trace(args.trace), args.rate)
    write_trace(records, args.output)
    print(f"wrote {len(records)} requests at {args.rate} req/s to {args.output}")
    return 0


def _window(args: argparse.Namespace) -> int:
    from epd_engine.contracts.trace import tail_window, window, write_trace

    records = load_trace(args.trace)
    if args.last is not None:
        selected = tail_window(records, args.last)
    else:
        try:
            selected = window(records, args.start, args.end if args.end is not None else 1e18)
        except ValueError as exc:
            raise UserError(str(exc)) from exc
    write_trace(selected, args.output)
    print(f"wrote {len(selected)} of {len(records)} requests to {args.output}")
    return 0


def _split(args: argparse.Namespace) -> int:
    from epd_engine.contracts.trace import split_history, write_trace

    try:
        history, evaluation = split_history(load_trace(args.trace), args.history_fraction)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    write_trace(history, args.history)
    write_trace(evaluation, args.rest)
    print(f"history: {len(history)} requests -> {args.history}")
    print(f"rest: {len(evaluation)} requests -> {args.rest}")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from epd_engine.bench.token_prompts import PromptLengthError, TokenExactPrompts
    from epd_engine.contracts.trace import write_trace
    from epd_engine.workload.trace_formats import write_mooncake

    if args.tokenizer and args.to != "mooncake":
        raise UserError("--tokenizer writes prompt texts: it needs --to mooncake")
    if args.block_size < 1:
        raise UserError(f"--block-size must be >= 1, got {args.block_size}")
    records = load_trace(args.trace, args.format)
    if args.to != "mooncake":
        write_trace(records, args.output)
    elif args.tokenizer:
        try:
            prompts = TokenExactPrompts.from_model_dir(args.tokenizer, args.prompt_count)
        except (OSError, ValueError, PromptLengthError) as exc:
            raise UserError(f"--tokenizer {args.tokenizer}: {exc}") from exc
        write_mooncake(records, args.output, prompts, args.block_size)
    else:
        write_mooncake(records, args.output)
    texts = f", prompt texts ({args.prompt_count} count)" if args.tokenizer else ""
    print(f"wrote {len(records)} requests ({args.to}{texts}) to {args.output}")
    return 0


def _workloads(args: argparse.Namespace) -> int:
    from epd_engine.workload.generators import describe_workloads

    rows = describe_workloads()
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
        return 0
    for row in rows:
        print(
            f"{row['name']:<18} prompt {row['mean_prompt_tokens']:>6} tok  "
            f"out {row['mean_output_tokens']:>6} tok  "
            f"images/req {row['mean_images_per_request']:<5}"
            f" {row['summary']}\n{'':<18} source: {row['source']}"
        )
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("trace", help="generate, inspect, rescale and window traces")
    sub = parser.add_subparsers(dest="trace_command", metavar="ACTION", required=True)

    gen = sub.add_parser("generate", help="synthesize a trace from a workload generator")
    add_workload_args(gen, required=True)
    gen.add_argument("-o", "--output", type=Path, required=True, help="JSONL file to write")
    gen.set_defaults(func=_generate)

    show = sub.add_parser("show", help="summarize a trace (requests, rate, tokens, images)")
    show.add_argument("trace")
    add_format_arg(show)
    show.add_argument("--json", action="store_true")
    show.set_defaults(func=_show)

    convert = sub.add_parser(
        "convert", help="read Mooncake JSONL, BurstGPT or Azure CSV; write ours or Mooncake's"
    )
    convert.add_argument("trace")
    add_format_arg(convert)
    convert.add_argument("--to", choices=("epd", "mooncake"), default="epd")
    convert.add_argument(
        "--tokenizer",
        metavar="MODEL_DIR",
        help="with --to mooncake: write each prompt's text (text_input), token-exact with "
        "this model's tokenizer, instead of its length",
    )
    convert.add_argument(
        "--prompt-count",
        choices=("template", "content"),
        default="template",
        help="template: the server counts the text's tokens with the chat template (default); "
        "content: the text alone has the count",
    )
    convert.add_argument(
        "--block-size", type=int, default=512, help="tokens per hash_ids block (default 512)"
    )
    convert.add_argument("-o", "--output", type=Path, required=True)
    convert.set_defaults(func=_convert)

    scale = sub.add_parser("scale", help="replay a trace's arrival pattern at another rate")
    scale.add_argument("trace")
    scale.add_argument("--rate", type=float, required=True, help="target mean rate, req/s")
    scale.add_argument("-o", "--output", type=Path, required=True)
    scale.set_defaults(func=_scale)

    win = sub.add_parser("window", help="cut a time window (rebased to start at 0)")
    win.add_argument("trace")
    win.add_argument("--start", type=float, default=0.0, help="seconds (inclusive)")
    win.add_argument("--end", type=float, help="seconds (exclusive)")
    win.add_argument("--last", type=float, help="the last N seconds instead of --start/--end")
    win.add_argument("-o", "--output", type=Path, required=True)
    win.set_defaults(func=_window)

    split = sub.add_parser(
        "split", help="first fraction for profiling, rest for evaluation (HydraInfer: 1/10)"
    )
    split.add_argument("trace")
    split.add_argument("--history-fraction", type=float, default=0.1)
    split.add_argument("--history", type=Path, required=True, help="JSONL for the first part")
    split.add_argument("--rest", type=Path, required=True, help="JSONL for the rest (rebased)")
    split.set_defaults(func=_split)

    workloads = sub.add_parser("workloads", help="list workload generators and their sources")
    workloads.add_argument("--json", action="store_true")
    workloads.set_defaults(func=_workloads)
