"""``epdctl router``: run the router (OpenAI endpoint in front of the role pools)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from epd_engine.api.keep_alive import IDLE_KEEP_ALIVE_S
from epd_engine.api.log_setup import setup_logging
from epd_engine.cli import UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("router", help="run the router in front of engine instances")
    p.add_argument("--config", type=Path, help="router.json (the operator's ConfigMap)")
    p.add_argument("--model", help="served model name (overrides the config)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--trace-dir", type=Path, help="write the live trace here (rotating JSONL)")
    p.add_argument("--slo-ttft", type=float, help="TTFT SLO in seconds")
    p.add_argument("--slo-tpot", type=float, help="TPOT SLO in seconds")
    p.add_argument("--slo-attainment", type=float, help="share of requests to meet both SLOs (0-1]")
    p.add_argument("--plan", type=Path, help="plan JSON it serves (epd_plan_info; `epdctl plan`)")
    p.add_argument("--instance-timeout", type=float, help="drop an instance after this silence (s)")
    p.add_argument("--max-request-bytes", type=int, help="larger bodies get 413")
    p.add_argument(
        "--progress-timeout", type=float, help="fail a request with no event for this long (s)"
    )
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=run)


def settings_from(args: argparse.Namespace):
    from epd_engine.router.settings import RouterSettings

    plan = None
    if args.plan is not None:
        try:
            plan = json.loads(args.plan.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise UserError(f"cannot read plan {args.plan}: {exc}") from exc
    overrides = {
        "model": args.model,
        "plan": plan,
        "trace_dir": args.trace_dir,
        "slo_ttft_s": args.slo_ttft,
        "slo_tpot_s": args.slo_tpot,
        "slo_attainment": args.slo_attainment,
        "instance_timeout_s": args.instance_timeout,
        "max_request_bytes": args.max_request_bytes,
        "progress_timeout_s": args.progress_timeout,
    }
    try:
        if args.config is not None:
            settings = RouterSettings.from_file(args.config, **overrides)
        else:
            settings = RouterSettings(**{k: v for k, v in overrides.items() if v is not None})
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    if settings.plan is not None:
        from epd_engine.router.plan_info import plan_labels

        try:
            plan_labels(settings.plan)
        except ValueError as exc:
            raise UserError(f"invalid plan: {exc}") from exc
    return settings


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from epd_engine.router.app import create_app

    setup_logging(args.log_level)
    from epd_engine.config import internal_token_set

    if not internal_token_set():
        raise UserError(
            "the router needs the deployment's secret in EPD_INTERNAL_TOKEN (instances register "
            "with it); `epdctl up` and the operator set it"
        )
    app = create_app(settings_from(args), freeze_heap=True)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_keep_alive=IDLE_KEEP_ALIVE_S,
    )
    return 0
