"""How far the tensor-parallel projection (``profiler/tensor_parallel.py``) is from a
measurement: profile the model on one rank and on N ranks (``profile-costs
--tensor-parallel-size``) in the same run, measure the ranks' all-reduce link
(``bench/allreduce_link.py``: gloo here), project the one-rank model to N over it, and
compare with every batch the N-rank profile timed.

    python benchmarks/bench_tp_projection.py --model models/tiny-llava --size 2 \\
        --out benchmarks/results/tp-projection-cpu.json
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch

from epd_engine.bench.allreduce_link import measure_allreduce_link
from epd_engine.bench.profile_costs import ProfileConfig, profile_costs
from epd_engine.bench.results_file import write_results
from epd_engine.model.registry import load_model_config
from epd_engine.profiler.rank_costs import RankedShape
from epd_engine.profiler.tensor_parallel import projected
from epd_engine.transfer.memory import dtype_of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    base = {"model_dir": args.model, "rounds": args.rounds, "show_progress": True}
    one, _ = profile_costs(ProfileConfig(**base))
    measured_model, samples = profile_costs(ProfileConfig(**base, tensor_parallel_size=args.size))
    config = load_model_config(args.model)
    dtype = dtype_of(one.meta["model"]["dtype"])
    shape = RankedShape.of(config, torch.empty((), dtype=dtype).element_size())
    link = measure_allreduce_link(args.size, config.hidden_size, dtype)
    projection = projected(one, args.size, shape, link)
    rows: list[dict[str, Any]] = []
    for sample in samples:
        if sample.kind == "encode":
            continue  # the encoder is not split: nothing projected
        rows.append({
            "kind": sample.kind,
            "num_tokens": sample.shape.num_tokens,
            "decode_kcontext": sample.shape.decode_kcontext,
            "measured_s": sample.seconds,
            "projected_s": projection.step_s(sample.shape),
            "one_rank_s": one.step_s(sample.shape),
        })  # fmt: skip
    ratios = [r["projected_s"] / r["measured_s"] for r in rows]
    summary = {
        "what": f"tensor-parallel projection to {args.size} ranks vs measured, {args.model.name}",
        "allreduce_link": {"latency_s": link.latency_s, "bytes_per_s": link.bytes_per_s},
        "projected_over_measured": {
            "min": min(ratios),
            "median": statistics.median(ratios),
            "max": max(ratios),
            "num_batches": len(ratios),
        },
        "measured_fixed_s": measured_model.language.fixed_s,
        "projected_fixed_s": projection.language.fixed_s,
        "one_rank_fixed_s": one.language.fixed_s,
    }
    write_results(args.out, summary, {"batches": rows})
    print(summary)


if __name__ == "__main__":
    main()
