"""``epdctl profile-costs``: measure iteration times on this machine with the real runner and
save a fitted cost model (JSON, with hardware/model/software versions) for simulate/plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from epd_engine.cli import UserError
from epd_engine.commands.serve import add_tensor_parallel_size


def _profile(args: argparse.Namespace) -> int:
    from epd_engine.bench.profile_costs import ProfileConfig, profile_costs, samples_json
    from epd_engine.config import SLO, Role
    from epd_engine.model.model_config import ModelFormatError
    from epd_engine.profiler.budgets import derive_budgets
    from epd_engine.profiler.cost_model import save_cost_model

    if args.reuse is not None:
        return _recalibrate(args)
    if args.model is None:
        raise UserError("--model is required (or --reuse COST.json --calibrate REPORT)")
    if args.preset and not (args.model / "config.json").is_file():
        from epd_engine.model.make_model import make_model

        make_model(args.preset, args.model, seed=0, dtype=args.dtype, show_progress=False)
    if not (args.model / "config.json").is_file():
        raise UserError(f"{args.model}: no config.json (make one with `epdctl make-model`)")
    if args.threads < 1 or args.kv_layers_per_group < 1:
        raise UserError("--threads and --kv-layers-per-group must be >= 1")
    try:
        slo = SLO(ttft_s=args.slo_ttft, tpot_s=args.slo_tpot)
        config = ProfileConfig(
            model_dir=args.model, device=args.device, dtype=args.dtype,
            num_kv_blocks=args.num_kv_blocks, kv_block_size=args.kv_block_size,
            num_image_blocks=args.num_image_blocks, max_num_running=args.max_num_running,
            max_images=args.max_images, max_prefill_tokens=args.max_prefill_tokens,
            max_decode_batch=args.max_decode_batch, repeats=args.repeats, rounds=args.rounds,
            cpu_threads=args.threads, kv_layers_per_group=args.kv_layers_per_group,
            show_progress=not args.no_progress, tensor_parallel_size=args.tensor_parallel_size,
        )  # fmt: skip
        model, samples = profile_costs(config)
    except (ModelFormatError, ValueError) as exc:
        raise UserError(str(exc)) from exc
    budgets: dict[str, Any] = {}
    for role in Role:
        found = derive_budgets(model, role, slo)
        budgets[role.value] = found.model_dump() if found else None
    meta = dict(model.meta)
    meta["budgets"] = {"slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}, "alpha": 0.5, **budgets}
    model = dataclasses.replace(model, meta=meta)
    if args.calibrate:
        model = _calibrated(model, args.calibrate)
    path = save_cost_model(model, args.out)
    if args.samples:
        args.samples.parent.mkdir(parents=True, exist_ok=True)
        args.samples.write_text(json.dumps(samples_json(samples, model), indent=2) + "\n")
    fit = meta["fit"]
    print(
        f"cost model: {path}  ({fit['num_samples']} samples; mean relative error "
        f"encode {fit['encode_mean_rel_error']:.1%}, language {fit['language_mean_rel_error']:.1%})"
    )
    for name, found in budgets.items():
        print(f"  {name:>3}: {found if found else 'SLO cannot be met (batch of one is too slow)'}")
    for name, link in model.links.items():
        used = "  (auto on one host)" if name == model.transfer_backend else ""
        print(f"  link {name:<10} {link.latency_s * 1e6:7.0f} us per transfer, "
              f"{link.bytes_per_s / 1e9:6.2f} GB/s{used}")  # fmt: skip
    return 0


def _calibrated(model: Any, report_path: Path) -> Any:
    from epd_engine.bench.report import load_report, results_from_report
    from epd_engine.profiler.calibrate import calibrate

    try:
        results = results_from_report(load_report(report_path))
        calibrated = calibrate(model, results, source=str(report_path))
    except ValueError as exc:
        raise UserError(f"{report_path}: {exc}") from exc
    o = calibrated.overheads
    print(f"calibrated on {report_path}: request overhead {o.request_s * 1e3:.1f} ms, "
          f"step overhead {o.step_s * 1e3:.2f} ms")  # fmt: skip
    return calibrated


def _recalibrate(args: argparse.Namespace) -> int:
    from epd_engine.profiler.cost_model import load_cost_model, save_cost_model

    if not args.calibrate:
        raise UserError("--reuse needs --calibrate REPORT (nothing else to change)")
    try:
        model = load_cost_model(args.reuse)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    print(f"cost model: {save_cost_model(_calibrated(model, args.calibrate), args.out)}")
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "profile-costs",
        help="measure iteration costs and transfer links; save a fitted cost model (JSON)",
        description="Times encode, prefill, decode and co-located batches on this machine, "
        "each transfer backend's per-transfer latency and bandwidth (pages pulled across "
        "processes, as bench-transfer does), fits the cost model the simulator and planner "
        "use, and derives the SLO budgets the way the engine does at start-up.",
    )
    p.add_argument("--model", type=Path, help="checkpoint directory (HF layout)")
    p.add_argument(
        "--calibrate",
        type=Path,
        help="`epdctl bench` report of our live system: fit router/engine overheads from it",
    )
    p.add_argument("--reuse", type=Path, help="calibrate this cost model instead of measuring")
    p.add_argument("--preset", help="make a random-weight checkpoint of this preset first")
    p.add_argument("--out", type=Path, required=True, help="cost model JSON to write")
    p.add_argument("--samples", type=Path, help="also write the raw samples (JSON)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--num-kv-blocks", type=int, default=512)
    p.add_argument("--kv-block-size", type=int, default=16)
    p.add_argument("--num-image-blocks", type=int, default=64)
    p.add_argument("--max-num-running", type=int, default=256)
    p.add_argument("--max-images", type=int, default=16, help="largest encode batch measured")
    p.add_argument("--max-prefill-tokens", type=int, default=1024)
    p.add_argument("--max-decode-batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per batch (best kept)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved passes over all batches")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads on CPU (default 1, what each engine instance runs with)",
    )
    add_tensor_parallel_size(
        p,
        "time the language model split over this many ranks (gloo on a CPU, NCCL on GPUs), "
        "as `serve --tensor-parallel-size` runs it; the vision tower stays whole",
    )
    p.add_argument(
        "--kv-layers-per-group",
        type=int,
        default=8,
        help="KV moves in groups of this many layers, one transfer each (as the engine: 8)",
    )
    p.add_argument("--slo-ttft", type=float, default=4.0, help="TTFT SLO for the budgets, s")
    p.add_argument("--slo-tpot", type=float, default=0.08, help="TPOT SLO for the budgets, s")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_profile)
