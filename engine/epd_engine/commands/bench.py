"""``epdctl bench``: replay a trace (or a generated workload) against an OpenAI-compatible
endpoint and report latency, SLO attainment and goodput (JSON + PNG plots).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from epd_engine.cli import UserError
from epd_engine.commands.trace import (
    add_format_arg,
    add_workload_args,
    generate_from_args,
    load_trace,
)


def _rates(text: str) -> list[float]:
    try:
        rates = sorted({float(part) for part in text.split(",") if part.strip()})
    except ValueError as exc:
        raise UserError(f"--sweep expects comma-separated rates, got {text!r}") from exc
    if not rates or rates[0] <= 0:
        raise UserError(f"--sweep rates must be > 0, got {text!r}")
    return rates


def _concurrencies(text: str) -> list[int]:
    try:
        levels = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError as exc:
        raise UserError(f"--concurrency expects comma-separated integers, got {text!r}") from exc
    if not levels or levels[0] < 1:
        raise UserError(f"--concurrency levels must be >= 1, got {text!r}")
    return levels


def _prompt_builder(args: argparse.Namespace, model: str) -> Any:
    """The tokenizer-backed prompt builder, or None (word prompts, approximate) with a note."""
    from epd_engine.bench.token_prompts import PromptLengthError, TokenExactPrompts

    source = args.tokenizer or model
    if source == "none" or not Path(source).is_dir():
        why = "--tokenizer none" if source == "none" else f"no tokenizer directory {source!r}"
        print(f"note: {why}: prompt lengths are approximate (words, not tokens); "
              "pass --tokenizer MODEL_DIR for exact lengths")  # fmt: skip
        return None
    try:
        prompts = TokenExactPrompts.from_model_dir(source, args.prompt_count)
    except (OSError, ValueError, PromptLengthError) as exc:
        raise UserError(f"--tokenizer {source}: {exc}") from exc
    counted = "chat template included" if args.prompt_count == "template" else "content only"
    print(f"prompts: exact token counts with the {source} tokenizer ({counted})")
    return prompts


def _discover_model(endpoint: str, api_key: str) -> str:
    """The first model the endpoint serves (``GET /models``), or a clear error."""
    import httpx

    url = endpoint.rstrip("/") + "/models"
    try:
        response = httpx.get(url, headers={"Authorization": f"Bearer {api_key}"}, timeout=10)
        response.raise_for_status()
        models = [m["id"] for m in response.json().get("data", [])]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"cannot list models at {url} ({exc}); pass --model") from exc
    if not models:
        raise UserError(f"{url} lists no models; pass --model")
    return str(models[0])


def _records(args: argparse.Namespace) -> list[Any]:
    from epd_engine.workload.arrivals import at_rate

    if args.trace and args.workload:
        raise UserError("use either --trace or --workload, not both")
    if args.trace:
        records = load_trace(args.trace, args.format)
        if args.rate is not None:
            if args.rate <= 0:
                raise UserError(f"--rate must be > 0, got {args.rate}")
            records = at_rate(records, args.rate)
        if args.num_limit is not None:
            records = records[: args.num_limit]
        return records
    if args.workload:
        return generate_from_args(args)
    raise UserError("give a trace (--trace FILE) or a workload (--workload NAME --rate R)")


def _print_summary(summary: Any, label: str) -> None:
    def row(name: str, stats: Any) -> str:
        return (
            f"  {name:<9} mean {stats.mean_s:8.4f}  p50 {stats.p50_s:8.4f}  "
            f"p90 {stats.p90_s:8.4f}  p99 {stats.p99_s:8.4f}  s"
        )

    print(
        f"{label or 'run'}: {summary.num_ok}/{summary.num_requests} ok "
        f"in {summary.duration_s:.1f} s, "
        f"{summary.request_throughput_rps:.2f} req/s, {summary.output_throughput_tps:.1f} tok/s"
    )
    for name in ("ttft", "tpot", "tpot_p90", "itl", "e2e"):
        print(row(name, getattr(summary, name)))
    if summary.attainment is not None:
        print(f"  SLO attainment {summary.attainment:.1%}")
    if summary.cached_prompt_tokens:
        print(f"  prompt tokens served from the server's cache: {summary.cached_prompt_tokens}")
    if summary.errors:
        print(f"  errors: {json.dumps(summary.errors)}")
    if summary.num_output_mismatches:
        print(f"  warning: {summary.num_output_mismatches} requests got another number of tokens "
              "than asked (does the server honour min_tokens / ignore_eos?)")  # fmt: skip
    if summary.num_prompt_mismatches:
        print(f"  warning: {summary.num_prompt_mismatches} requests' usage.prompt_tokens differ "
              f"from the intended count by {summary.mean_prompt_mismatch:+.1f} on average "
              "(another tokenizer, or image tokens of another model family?)")  # fmt: skip
    if summary.max_send_delay_s > 0.05:
        print(f"  warning: the client lagged up to {summary.max_send_delay_s:.2f} s behind the "
              "trace (raise --max-concurrency, or the machine is overloaded)")  # fmt: skip


def _workload_settings(args: argparse.Namespace, config: Any) -> dict[str, Any]:
    """How prompts and outputs were built, so a report states what its lengths mean."""
    prompts = config.prompts
    return {
        "prompt_tokens": "exact" if prompts else "approximate (words)",
        "prompt_count": prompts.mode if prompts else None,
        "tokenizer": (args.tokenizer or config.model) if prompts else None,
        "output_tokens": "max_tokens + min_tokens + ignore_eos"
        if config.exact_output
        else "max_tokens only",
        "warmup_requests": config.warmup_requests,
        "duration_s": config.duration_s,
        "grace_s": config.grace_s if config.duration_s is not None else None,
    }


def _stage_means(report: dict[str, Any]) -> dict[str, float]:
    """Server-reported stage means, else the client-side split: first token vs decode."""
    summary = report["summary"]
    if summary.get("stage_mean_s"):
        return dict(summary["stage_mean_s"])
    ttft_s, e2e_s = summary["ttft"]["mean_s"], summary["e2e"]["mean_s"]
    return {"to first token": ttft_s, "decode": max(0.0, e2e_s - ttft_s)}


def _plots(out_dir: Path, report: dict[str, Any], compare: list[dict[str, Any]], slo: Any) -> None:
    from epd_engine.bench import plots
    from epd_engine.bench.report import attainment_curve, has_requests, results_from_report

    reports = [*compare, report] if report else compare
    curves = {r["label"] or f"run {i}": attainment_curve(r) for i, r in enumerate(reports)}
    curves = {k: v for k, v in curves.items() if v}
    written = []
    if curves:
        goodputs = {r["label"]: r["goodput_rps"] for r in reports if r.get("goodput_rps")}
        written.append(
            plots.plot_attainment(
                curves, out_dir / "attainment_vs_rate.png", target=slo.attainment, goodputs=goodputs
            )
        )
    for r in reports:
        if not has_requests(r):
            print(f"no latency CDF for {r['label']!r}: its raw file is not here")
    runs = {
        r["label"] or f"run {i}": results_from_report(r)
        for i, r in enumerate(reports)
        if has_requests(r)
    }
    runs = {k: v for k, v in runs.items() if v}
    if runs:
        written.append(plots.plot_latency_cdfs(runs, out_dir / "latency_cdf.png", slo))
    stages = {
        r["label"] or f"run {i}": _stage_means(r) for i, r in enumerate(reports) if r.get("summary")
    }
    if stages:
        written.append(plots.plot_stage_breakdown(stages, out_dir / "stage_breakdown.png"))
    for path in written:
        print(f"plot: {path}")


def _bench(args: argparse.Namespace) -> int:
    from epd_engine.bench.closed_loop import closed_loop
    from epd_engine.bench.driver import DriverConfig, payloads_for, rate_runner, replay
    from epd_engine.bench.report import build_report, export_requests, load_report, write_report
    from epd_engine.bench.server_metrics import metrics_report, scrape
    from epd_engine.config import SLO
    from epd_engine.contracts.trace import mean_rate_rps, summarize_trace, write_trace
    from epd_engine.slo.goodput import find_goodput, sweep
    from epd_engine.slo.outcomes import summarize

    try:
        slo = SLO(ttft_s=args.slo_ttft, tpot_s=args.slo_tpot, attainment=args.attainment)
        compare = [load_report(path) for path in args.compare]
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    if args.endpoint is None:
        if not (compare and args.plots):
            raise UserError(
                "--endpoint is required (or --compare REPORTS --plots DIR to plot only)"
            )
        _plots(args.plots, {}, compare, slo)
        return 0

    if args.concurrency and (args.sweep or args.goodput):
        raise UserError("--concurrency is a closed loop; it does not combine with rate searches")
    records = _records(args)
    model = args.model or _discover_model(args.endpoint, args.api_key)
    label = args.label or model
    try:
        config = DriverConfig(
            endpoint=args.endpoint, model=model, api_key=args.api_key,
            max_concurrency=args.max_concurrency, max_duration_s=args.max_duration,
            request_timeout_s=args.timeout, ignore_eos=not args.no_ignore_eos,
            exact_output=not args.no_ignore_eos, progress=not args.no_progress, label=label,
            prompts=_prompt_builder(args, model), block_tokens=args.block_size,
            duration_s=args.duration, grace_s=args.grace_period,
            warmup_requests=args.warmup,
        )  # fmt: skip
    except ValueError as exc:
        raise UserError(str(exc)) from exc

    metrics_before = scrape(args.endpoint, args.api_key) if not args.no_server_metrics else None
    by_rate: dict[float, list[Any]] = {}
    by_concurrency: dict[int, list[Any]] = {}
    search = None
    if args.concurrency:
        messages = payloads_for(records, config)
        for level in _concurrencies(args.concurrency):
            by_concurrency[level] = closed_loop(records, config, level, messages)
            point = summarize(by_concurrency[level], slo)
            print(f"concurrency {level:4d}  {point.request_throughput_rps:8.2f} req/s  "
                  f"ttft p50 {point.ttft.p50_s:.4f} s  errors {point.num_errors}")  # fmt: skip
        results = by_concurrency[max(by_concurrency)]
    elif args.sweep or args.goodput:
        run = rate_runner(records, config)

        def keep(point: Any, samples: Any) -> None:
            by_rate[point.rate_rps] = list(samples)
            print(f"rate {point.rate_rps:8.3f} req/s  attainment {point.attainment:6.1%}  "
                  f"{'pass' if point.passed else 'FAIL'}")  # fmt: skip

        if args.sweep:
            search = sweep(run, _rates(args.sweep), slo, on_point=keep)
        else:
            start = args.goodput_start or args.rate or mean_rate_rps(records) or 1.0
            search = find_goodput(run, slo, start_rps=start, min_rps=min(start, args.goodput_min),
                                  max_rps=max(start, args.goodput_max),
                                  rel_tolerance=args.goodput_tolerance, on_point=keep)  # fmt: skip
        main_rate = search.goodput_rps or min(by_rate)
        results = by_rate[main_rate]
        print(f"goodput {search.goodput_rps:.3f} req/s (lowest failing rate: "
              f"{search.lowest_failing_rps}); details below at {main_rate:.3f} req/s")  # fmt: skip
    else:
        results = replay(records, config)
    summary = summarize(results, slo)
    _print_summary(summary, label)

    mode = ("concurrency" if args.concurrency else "sweep" if args.sweep
            else "goodput" if args.goodput else "single")  # fmt: skip
    extra: dict[str, Any] = {"workload": _workload_settings(args, config)}
    # Every rate's requests too (the profiler calibrates on a whole sweep, not one rate).
    if by_rate:
        extra["requests_by_rate"] = {
            str(rate): [r.to_dict() for r in samples] for rate, samples in by_rate.items()
        }
    if by_concurrency:
        extra["concurrency_points"] = [
            {"concurrency": level, "summary": summarize(samples, slo).to_dict()}
            for level, samples in by_concurrency.items()
        ]
    if metrics_before is not None:
        extra["server_metrics"] = metrics_report(
            metrics_before, scrape(args.endpoint, args.api_key)
        )
    report = build_report(
        label=label, slo=slo, trace=summarize_trace(records), summary=summary,
        results=results, search=search, mode=mode, endpoint=args.endpoint, model=model,
        extra=extra,
    )  # fmt: skip
    if report.get("emulated"):
        print(f"NOTE: {report['emulated_note']}")
    if args.out:
        print(f"results: {write_report(report, args.out)}")
    if args.export_requests:
        runs: dict[Any, list[Any]] = dict(by_concurrency or by_rate) or {None: results}
        key = "concurrency" if by_concurrency else "rate_rps"
        path = export_requests(args.export_requests, runs, key)
        print(f"per-request results: {path}")
    if args.save_trace and mode == "single":
        measured = [r.to_trace_record(rec) for r, rec in zip(results, records, strict=True)]
        print(f"measured trace: {write_trace(measured, args.save_trace)}")
    if args.plots:
        _plots(args.plots, report, compare, slo)
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="load-test an OpenAI-compatible endpoint: latency, SLO attainment, goodput",
        description="Replay a trace or a generated workload; fixes output lengths with "
        "max_tokens + ignore_eos and measures TTFT, every inter-token gap and e2e latency.",
    )
    parser.add_argument("--endpoint", help="base URL incl. /v1, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--model", help="model name (default: first from GET /v1/models)")
    parser.add_argument("--api-key", default="EMPTY")
    parser.add_argument("--trace", help="trace to replay: ours (DESIGN.md §4), Mooncake-style "
                        "JSONL, BurstGPT or Azure LLM inference CSV")  # fmt: skip
    add_format_arg(parser)
    parser.add_argument("--num-limit", type=int, help="replay only the first N trace requests")
    add_workload_args(parser, required=False)
    slo = parser.add_argument_group("SLO (defaults: HydraInfer v2, LLaVA-1.5-7B)")
    slo.add_argument("--slo-ttft", type=float, default=4.0, help="TTFT SLO, s (default 4)")
    slo.add_argument("--slo-tpot", type=float, default=0.08, help="TPOT SLO, s (default 0.08)")
    slo.add_argument("--attainment", type=float, default=0.9, help="goodput target (default 0.9)")
    search = parser.add_mutually_exclusive_group()
    search.add_argument("--sweep", metavar="RATES", help="comma-separated rates, e.g. 1,2,4,8")
    search.add_argument("--goodput", action="store_true", help="find goodput by bisection")
    parser.add_argument("--goodput-start", type=float, help="first rate (default: trace rate)")
    parser.add_argument("--goodput-min", type=float, default=0.05)
    parser.add_argument("--goodput-max", type=float, default=1024.0)
    parser.add_argument("--goodput-tolerance", type=float, default=0.05, help="relative")
    lengths = parser.add_argument_group("exact lengths")
    lengths.add_argument("--tokenizer", help="model directory whose tokenizer builds prompts of "
                         "exact token counts (default: --model, if it is a directory; 'none': "
                         "approximate word prompts)")  # fmt: skip
    lengths.add_argument("--prompt-count", choices=("template", "content"), default="template",
                         help="template: the server's non-image prompt tokens (chat template "
                         "included, as the router records traces); content: the user text "
                         "alone (AIPerf/vLLM input length)")  # fmt: skip
    lengths.add_argument("--block-size", type=int, default=512,
                         help="tokens per hash_ids block of Mooncake-style traces")  # fmt: skip
    modes = parser.add_argument_group("load modes")
    modes.add_argument("--concurrency", metavar="N[,N...]",
                       help="closed loop: N clients back to back; a list sweeps")  # fmt: skip
    modes.add_argument("--duration", type=float, help="send for this long (s); closed loop "
                       "cycles the trace, open loop drops later arrivals")  # fmt: skip
    modes.add_argument("--grace-period", type=float, default=30.0,
                       help="after --duration, wait for in-flight ones (s)")  # fmt: skip
    modes.add_argument("--warmup", type=int, default=0, help="warm-up requests, not measured")
    modes.add_argument("--export-requests", type=Path, help="per-request results as JSONL")
    modes.add_argument("--no-server-metrics", action="store_true",
                       help="do not capture the server's /metrics before and after")  # fmt: skip
    parser.add_argument("--max-concurrency", type=int, default=256)
    parser.add_argument("--max-duration", type=float, help="wall-clock bound per run, s")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s")
    parser.add_argument("--no-ignore-eos", action="store_true",
                        help="let the model stop early (no ignore_eos, no min_tokens)")  # fmt: skip
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--label", help="name of this run in reports/plots, e.g. the method")
    parser.add_argument("--out", type=Path, help="JSON results file")
    parser.add_argument("--plots", type=Path, help="directory for PNG plots")
    parser.add_argument("--compare", nargs="*", default=[], help="earlier reports to plot along")
    parser.add_argument("--save-trace", type=Path, help="write the measured trace (single run)")
    parser.set_defaults(func=_bench)
