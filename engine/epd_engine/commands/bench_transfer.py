"""``epdctl bench-transfer``: each transfer backend's pull time and bandwidth across processes,
divided by the physical limit of the same bytes in the same run. JSON + a short table."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from epd_engine.bench.results_file import write_results
from epd_engine.cli import UserError
from epd_engine.commands.bench_disagg import environment_info

SHAPES = ("tiny", "llava-1.5-7b")


def _names(text: str, known: tuple[str, ...], flag: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise UserError(f"{flag}: unknown {unknown or 'empty'}; known: {', '.join(known)}")
    return names


def _gbps(value: float) -> str:
    return f"{value / 1e9:6.2f}"


def format_table(shapes: list[dict[str, Any]]) -> str:
    """p50/p90 of whole pulls in ms, bandwidth in GB/s, ratio to the limit; page latency in us."""
    head = (f"{'shape':<13} {'backend':<10} {'case':<5} {'p50 ms':>8} {'p90 ms':>8} {'GB/s':>6}"
            f" {'limit':>6} {'ratio':>6} {'goal':>5}")  # fmt: skip
    lines = [head]
    for shape in shapes:
        for name, result in shape["backends"].items():
            for case in ("kv", "image"):
                c = result[case]
                mark = "ok" if c["goal_met"] else "MISS"
                lines.append(
                    f"{shape['name']:<13} {name:<10} {case:<5} {c['pull']['p50_s'] * 1e3:8.2f} "
                    f"{c['pull']['p90_s'] * 1e3:8.2f} {_gbps(c['pull']['bandwidth_Bps'])} "
                    f"{_gbps(c['limit']['bandwidth_Bps'])} {c['ratio']:6.2f} {mark:>5}"
                )
            page = result["page"]
            lines.append(
                f"{'':<13} {name:<10} page  p50 {page['pull']['p50_s'] * 1e6:7.0f} us  "
                f"p90 {page['pull']['p90_s'] * 1e6:7.0f} us  (limit p50 "
                f"{page['limit']['p50_s'] * 1e6:5.0f} us)"
            )
            if not result["verified"]:
                lines.append(f"{'':<13} {name:<10} BYTES DIFFER from the source's")
    return "\n".join(lines)


def default_backends() -> str:
    """Every CPU backend; nixl only where NIXL is installed (named, its absence is an error)."""
    from epd_engine.transfer.nixl_agent import nixl_missing

    if (why := nixl_missing()) is not None:
        print(f"bench-transfer: nixl left out: {why}")
        return "tcp,shm,collective"
    return "tcp,shm,collective,nixl"


def _bench_transfer(args: argparse.Namespace) -> int:
    if args.gpu:
        from epd_engine.bench.transfer_gpu import main as bench_gpu

        argv = ["--repeats", str(args.repeats), "--warmup", str(args.warmup)]
        argv += ["--backends", args.backends or "cuda_ipc,nccl,nixl"]
        argv += [*(["--out", str(args.out)] if args.out else [])]
        argv += [*(["--run-dir", str(args.run_dir)] if args.run_dir else [])]
        return bench_gpu(argv)
    args.backends = args.backends or default_backends()
    import torch
    from tqdm import tqdm

    from epd_engine.bench import transfer_bench as tb
    from epd_engine.bench.transfer_shapes import llava_7b_shape, tiny_shape

    shapes = _names(args.shapes, SHAPES, "--shapes")
    backends = _names(args.backends, tb.BACKENDS, "--backends")
    if min(args.repeats, args.page_repeats, args.num_tokens, args.layers_per_group) < 1:
        raise UserError("--repeats, --page-repeats, --num-tokens, --layers-per-group must be >= 1")
    torch.set_num_threads(args.threads)  # as each engine instance runs (EngineConfig)
    build = {
        "tiny": lambda: tiny_shape(args.model, args.num_tokens, args.layers_per_group),
        "llava-1.5-7b": lambda: llava_7b_shape(args.num_tokens, args.layers_per_group),
    }
    repeats = tb.Repeats(bulk=args.repeats, page=args.page_repeats, warmup=args.warmup)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="epd-bench-transfer-"))
    environment = environment_info(["epdctl", *sys.argv[1:]])
    print(f"bench-transfer: logs under {run_dir}; load average {environment['loadavg_start']}")
    started = time.monotonic()
    results = []
    total = tb.num_steps(len(shapes), backends, repeats)
    with tqdm(total=total, desc="pulls", unit="pull", disable=args.no_progress) as bar:
        for name in shapes:
            shape = build[name]()
            bar.set_postfix_str(name)
            results.append(tb.bench_shape(shape, backends, repeats, run_dir, bar.update))
    environment["loadavg_end"] = os.getloadavg()
    environment["wall_s"] = round(time.monotonic() - started, 1)
    report = {
        "kind": "epd-bench-transfer",
        "version": 1,
        "environment": environment,
        "config": {
            "repeats": args.repeats,
            "page_repeats": args.page_repeats,
            "warmup": args.warmup,
            "torch_threads": torch.get_num_threads(),
            "auto": "shm on one host (tcp across)",
            "nixl": "UCX's choice between two processes on one host (CMA here)",
            "limits": {name: limit for name, (limit, _) in tb.GOALS.items()},
            "raw_limits_between": "two processes (link_peer sends, this process receives)",
        },
        "shapes": results,
        "summary": tb.summary(results),
    }
    print(format_table(results))
    if args.out:
        write_results(args.out, report, command=environment["command"])
        print(f"results: {args.out}")
    return 0 if all(b["verified"] for s in results for b in s["backends"].values()) else 1


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench-transfer",
        help="per backend: pull time, bandwidth and its ratio to the physical limit",
        description="Starts a page source per backend as its own process (caches of a real "
        "model's shape, random pages), pulls one request's KV (in layer groups), one image "
        "and one page into this process through each backend, and times a plain memcpy "
        "(shm; nixl, whose UCX reads with one kernel copy on one host), a raw loopback "
        "socket (tcp) and gloo's own send/recv (collective) of the same bytes in the same run.",
    )
    parser.add_argument(
        "--model", type=Path, default=Path("models/tiny-llava"),
        help="checkpoint whose config.json sets the tiny shape (default models/tiny-llava; "
        "the tiny-llava preset's shape without one)",
    )  # fmt: skip
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated (default all)")
    parser.add_argument(
        "--backends",
        help="comma-separated (default tcp,shm,collective,nixl; with --gpu cuda_ipc,nccl,nixl)",
    )
    parser.add_argument(
        "--gpu", action="store_true",
        help="the GPU backends (cuda_ipc, nccl, nixl) on LLaVA-1.5-7B caches on this machine's "
        "GPU: KV and image pull p50/p90 ms against a same-process device copy (bench/transfer_gpu)",
    )  # fmt: skip
    parser.add_argument("--num-tokens", type=int, default=640, help="KV tokens of the request")
    parser.add_argument("--layers-per-group", type=int, default=8, help="as the engine (8)")
    parser.add_argument("--repeats", type=int, default=20, help="timed KV and image pulls")
    parser.add_argument("--page-repeats", type=int, default=100, help="timed one-page pulls")
    parser.add_argument("--warmup", type=int, default=3, help="untimed pulls first")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (engine: 1)")
    parser.add_argument("--out", type=Path, help="JSON results file")
    parser.add_argument("--run-dir", type=Path, help="source process logs (default: temp)")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=_bench_transfer)
