"""``epdctl bench-gpu``: LLaVA-1.5-7B shapes on one GPU against the card's own floors (JSON +
a short table). Needs CUDA; random weights, nothing to download."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from epd_engine.cli import UserError


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['gpu']}: copy {result['copy_bandwidth_gb_s']} GB/s, "
        f"matmul {result['matmul_tflops']} TFLOP/s ({result['dtype']}, "
        f"{result['attention_backend']})",
        f"{'decode batch':<13} {'eager ms':>9} {'graph ms':>9} {'floor ms':>9} "
        f"{'eager/floor':>12} {'graph/floor':>12}",
    ]
    for d in result["decode"]:
        lines.append(
            f"{d['batch']:<13} {d['eager']['median_ms']:9.3f} {d['graph']['median_ms']:9.3f} "
            f"{d['hbm_floor_ms']:9.3f} {d['eager_over_floor']:12.2f} {d['graph_over_floor']:12.2f}"
        )
    p, e, s = result["prefill"], result["encode"], result["dual_stream"]
    lines.append(f"prefill {p['sequences']}x{p['tokens_each']}: {p['tokens_per_s']:.0f} tokens/s")
    lines.append(f"encode batch {e['images']}: {e['images_per_s']:.1f} images/s")
    lines.append(
        f"encode {s['images']} images beside decode {s['decode_batch']}: in-line / dual = "
        f"{s['in_line_over_dual']:.2f} (best possible {s['best_possible']:.2f})"
    )
    return "\n".join(lines)


def _bench_gpu(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        raise UserError("bench-gpu needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    from epd_engine.bench.gpu_bench import GpuBenchConfig, run_gpu_bench
    from epd_engine.bench.results_file import write_results

    cfg = GpuBenchConfig(dtype=args.dtype, runs=args.runs, attention=args.attention)
    result = run_gpu_bench(cfg, progress=lambda msg: print(f"bench-gpu: {msg}", flush=True))
    if args.out:
        write_results(args.out, result)
    print(format_table(result))
    if not args.out:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench-gpu", help="decode/prefill/encode/dual-stream at LLaVA-1.5-7B shapes on a GPU"
    )
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument(
        "--attention", default="auto", choices=("auto", "torch", "flashinfer"),
        help="attention kernels (auto: FlashInfer when installed)",
    )  # fmt: skip
    parser.add_argument("--runs", type=int, default=20, help="timed repetitions per figure")
    parser.add_argument("--out", type=Path, help="write the JSON here")
    parser.set_defaults(func=_bench_gpu)
