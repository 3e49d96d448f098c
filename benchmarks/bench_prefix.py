"""Prefix caching with the cache on and off, on a multi-turn workload or a Mooncake trace.

Per method (EPD, E+P+D), two local systems of the tiny model run side by side, one with
the prefix cache (the default) and one with ``--no-prefix-cache``; rounds alternate between
them so both see the same host load, and each round replays fresh requests (new texts and
pictures: no round finds another's pages). Two workloads (``--workload``):

- ``sessions``: conversations of ``--turns`` turns; each turn resends the whole
  conversation with its picture (``workload/sessions.py``). "Later" requests: turns 2+.
- ``mooncake``: a Mooncake-format trace (``hash_ids`` blocks of 512 tokens, as Mooncake's
  and AIPerf's ``mooncake_trace``), written to JSONL and read back with the project's reader:
  ``--groups`` shared prefixes of ``--shared-blocks`` blocks (a system prompt, a
  document), each opening ``--per-group`` requests ``--spacing-ms`` apart that end in a
  unique question; text only, as Mooncake's traces.
  "Later" requests: those after a prefix's first.

Reported per system and as on/off ratios (medians over rounds): TTFT p50 and p90 of all
requests and of the later ones, the prefill tokens the instances computed (from
``epd_batch_tokens`` less ``epd_batch_decode_requests``) and the KV pages migrations pulled
(``epd_migration_kv_pages_total{source="pulled"}``).

    python -m benchmarks.bench_prefix --model models/tiny-llava \\
        --out benchmarks/results/prefix-cpu.json
    python -m benchmarks.bench_prefix --model models/tiny-llava --workload mooncake \\
        --out benchmarks/results/prefix-mooncake-cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from epd_engine.bench.driver import DriverConfig, replay
from epd_engine.bench.results_file import write_results
from epd_engine.bench.static_system import LaunchSpec, LocalSystem
from epd_engine.bench.token_prompts import TokenExactPrompts
from epd_engine.config import Method
from epd_engine.contracts.plan import Budgets, Plan
from epd_engine.contracts.trace import ImageRef, TraceRecord
from epd_engine.local.ports import free_port
from epd_engine.slo.outcomes import RequestResult
from epd_engine.workload.trace_formats import read_mooncake

ENGINE_ARGS = ["--num-image-blocks", "32", "--max-num-running", "32"]
BUDGETS = Budgets(token_budget=256, image_budget=4)  # long prompts prefill in chunks
COUNTERS = (
    "epd_batch_tokens_sum",
    "epd_batch_decode_requests_sum",
    "epd_migration_kv_pages_total",
)


FIRST_TURN_TOKENS = 1200  # a long first message (a document, a system prompt)
LATER_TURN_TOKENS = 100
OUTPUT_TOKENS = 16
MOONCAKE_BLOCK_TOKENS = 512  # Mooncake's hash_ids block
QUESTION_TOKENS = 120  # after its group's shared blocks, a question of its own


def sessions(round_index: int, num_sessions: int, num_turns: int) -> list[TraceRecord]:
    """Turn 1: a picture and a long first message; later turns: a short follow-up. Every
    round's texts and pictures are its own (request ids and image hashes seed them)."""
    records = []
    for s in range(num_sessions):
        for t in range(num_turns):
            picture = ImageRef(tokens=16, hash=f"r{round_index}-s{s}", width=64, height=48)
            records.append(
                TraceRecord(
                    request_id=f"r{round_index}-s{s}-t{t}",
                    arrival_s=0.4 * s + 1.0 * t,
                    prompt_tokens=FIRST_TURN_TOKENS if t == 0 else LATER_TURN_TOKENS,
                    images=(picture,) if t == 0 else (),
                    output_tokens=OUTPUT_TOKENS,
                    session_id=f"r{round_index}-s{s}",
                )
            )
    return records


def mooncake_requests(
    round_index: int, args: argparse.Namespace, directory: Path
) -> list[TraceRecord]:
    """The round's Mooncake trace: written as Mooncake JSONL, read back as any such file is
    (``trace_formats.read_mooncake``). Groups interleave, ``--spacing-ms`` apart; each
    round's block ids and request ids are its own."""
    base = round_index * 1_000_000
    shared = args.shared_blocks
    rows = []
    for i in range(args.groups * args.per_group):
        group = i % args.groups
        blocks = [base + group * shared + k for k in range(shared)]
        rows.append({
            "timestamp": args.spacing_ms * i,
            "input_length": shared * MOONCAKE_BLOCK_TOKENS + QUESTION_TOKENS,
            "output_length": OUTPUT_TOKENS,
            "hash_ids": blocks,
        })  # fmt: skip
    path = directory / f"mooncake-round{round_index}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return [
        r.model_copy(update={"request_id": f"r{round_index}-{r.request_id}"})
        for r in read_mooncake(path)
    ]


def later_requests(records: list[TraceRecord]) -> set[str]:
    """Requests after the first of their session (turns 2+) or of their prefix blocks."""
    seen: set[object] = set()
    later = set()
    for record in sorted(records, key=lambda r: r.arrival_s):
        key = record.session_id or (record.hash_ids or (record.request_id,))[0]
        if key in seen:
            later.add(record.request_id)
        seen.add(key)
    return later


def scrape(spec: LaunchSpec) -> dict[str, float]:
    """The counters, summed over every instance of the system."""
    pools = httpx.get(f"{spec.router_url}/internal/pools", headers=spec.headers()).json()
    totals = dict.fromkeys(COUNTERS, 0.0)
    for pool in pools["pools"].values():
        for instance in pool["instances"]:
            text = httpx.get(f"{instance['url']}/metrics", timeout=10).text
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    name = sample.name
                    if name == "epd_migration_kv_pages_total":
                        name += f"{{{sample.labels['source']}}}"
                        totals.setdefault(name, 0.0)
                    if name in totals:
                        totals[name] += sample.value
    return totals


def ttft(results: list[RequestResult], only: set[str] | None = None) -> dict[str, float]:
    values = [
        r.ttft_s for r in results if r.ttft_s is not None and (only is None or r.request_id in only)
    ]
    return {
        "p50_s": float(np.percentile(values, 50)),
        "p90_s": float(np.percentile(values, 90)),
        "n": len(values),
    }


def run_round(
    system: LocalSystem, prompts: TokenExactPrompts, records: list[TraceRecord]
) -> tuple[dict[str, Any], list[RequestResult]]:
    before = scrape(system.spec)
    config = DriverConfig(
        endpoint=f"{system.spec.router_url}/v1", model="tiny-llava", progress=False,
        prompts=prompts, max_concurrency=64,
    )  # fmt: skip
    results = replay(records, config)
    after = scrape(system.spec)
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[:3]}")
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return {
        "ttft_all": ttft(results),
        "ttft_later": ttft(results, later_requests(records)),
        "prefill_tokens": delta["epd_batch_tokens_sum"] - delta["epd_batch_decode_requests_sum"],
        "kv_pages_pulled": delta.get("epd_migration_kv_pages_total{pulled}", 0.0),
        "kv_pages_found": delta.get("epd_migration_kv_pages_total{cache}", 0.0),
        "cached_tokens": sum(r.server_cached_tokens or 0 for r in results),
        "prompt_tokens": sum(r.server_prompt_tokens or 0 for r in results),
    }, results


def start(
    model: Path, run_dir: Path, method: Method, cache: bool, num_kv_blocks: int, stack: ExitStack
) -> LocalSystem:
    plan = Plan(method=method, pools=dict.fromkeys(method.roles, 1),
                budgets=dict.fromkeys(method.roles, BUDGETS))  # fmt: skip
    args = [*ENGINE_ARGS, "--num-kv-blocks", str(num_kv_blocks)]
    args += [] if cache else ["--no-prefix-cache"]
    spec = LaunchSpec(
        name=f"prefix-{'on' if cache else 'off'}", model_name="tiny-llava", model_dir=model,
        plan=plan, router_port=free_port(), run_dir=run_dir, engine_args=args,
    )  # fmt: skip
    system = LocalSystem(spec)
    system.start()
    stack.callback(system.stop)
    system.wait_ready(timeout_s=300)
    return system


def ratio(on: float, off: float) -> float | None:
    return on / off if off else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--methods", default="EPD,E+P+D")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--workload", choices=("sessions", "mooncake"), default="sessions")
    parser.add_argument("--groups", type=int, default=4, help="mooncake: shared prefixes")
    parser.add_argument("--per-group", type=int, default=6, help="mooncake: requests each")
    parser.add_argument(
        "--shared-blocks", type=int, default=3, help="mooncake: 512-token blocks each shares"
    )
    parser.add_argument(
        "--spacing-ms", type=int, default=100, help="mooncake: between arrivals"
    )  # fmt: skip
    parser.add_argument(
        "--num-kv-blocks", type=int, default=1024,
        help="KV pages per instance (16 tokens each; the default holds every round's prefixes)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    prompts = TokenExactPrompts.from_model_dir(args.model)
    cache = {"num_kv_blocks": args.num_kv_blocks, "kv_block_size": 16,
             "token_budget": BUDGETS.token_budget, "rounds": args.rounds}  # fmt: skip
    if args.workload == "sessions":
        workload = {
            "kind": "sessions",
            "sessions": args.sessions,
            "turns": args.turns,
            "first_turn_tokens": FIRST_TURN_TOKENS,
            "later_turn_tokens": LATER_TURN_TOKENS,
            "output_tokens": OUTPUT_TOKENS,
            "images": "one 64x48 picture in turn 1",
            "later": "turns 2+",
            **cache,
        }
    else:
        workload = {"kind": "mooncake", "groups": args.groups, "per_group": args.per_group,
                    "shared_prefix_tokens": args.shared_blocks * MOONCAKE_BLOCK_TOKENS,
                    "spacing_ms": args.spacing_ms,
                    "question_tokens": QUESTION_TOKENS, "output_tokens": OUTPUT_TOKENS,
                    "block_tokens": MOONCAKE_BLOCK_TOKENS, "images": "none (text, as Mooncake's)",
                    "later": "requests after their prefix's first", **cache}  # fmt: skip
    report: dict[str, Any] = {"workload": workload, "methods": {}}
    raw: dict[str, Any] = {}
    for method in [Method(m) for m in args.methods.split(",")]:
        with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
            systems = {
                side: start(
                    args.model, Path(tmp) / side, method, side == "on", args.num_kv_blocks, stack
                )
                for side in ("on", "off")
            }
            rounds: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
            for index in range(args.rounds):
                order = ("on", "off") if index % 2 == 0 else ("off", "on")
                for side in order:  # both sides replay the same requests
                    if args.workload == "sessions":
                        records = sessions(index, args.sessions, args.turns)
                    else:
                        records = mooncake_requests(index, args, Path(tmp))
                    summary, results = run_round(systems[side], prompts, records)
                    rounds[side].append(summary)
                    raw[f"{method.value}/{side}/round{index}"] = [r.to_dict() for r in results]
                    print(method.value, side, index, summary, file=sys.stderr)
        report["methods"][method.value] = {"rounds": rounds, "ratios": ratios(rounds)}
    write_results(args.out, report, raw, command=sys.argv)
    print(args.out)
    return 0


def ratios(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """on/off per round (paired), then the median, min and max over rounds."""
    keys = {
        "ttft_p50_all": lambda s: s["ttft_all"]["p50_s"],
        "ttft_p90_all": lambda s: s["ttft_all"]["p90_s"],
        "ttft_p50_later": lambda s: s["ttft_later"]["p50_s"],
        "ttft_p90_later": lambda s: s["ttft_later"]["p90_s"],
        "prefill_tokens": lambda s: s["prefill_tokens"],
        "kv_pages_pulled": lambda s: s["kv_pages_pulled"],
    }
    out: dict[str, Any] = {}
    for name, get in keys.items():
        per_round = [
            ratio(get(on), get(off)) for on, off in zip(rounds["on"], rounds["off"], strict=True)
        ]
        values = [v for v in per_round if v is not None]
        if values:
            out[name] = {
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
                "rounds": values,
            }
    return out


if __name__ == "__main__":
    raise SystemExit(main())
