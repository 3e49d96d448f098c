"""``epdctl serve --emulate COST_MODEL``: run one emulated instance (imports no torch)."""

from __future__ import annotations

import argparse
from pathlib import Path

from epd_engine.api.draining import DrainingServer
from epd_engine.api.keep_alive import IDLE_KEEP_ALIVE_S
from epd_engine.api.log_setup import setup_logging
from epd_engine.cli import UserError
from epd_engine.config import SLO, Role, internal_token_set
from epd_engine.contracts.plan import Budgets
from epd_engine.emulate.app import EmulatedSettings, create_emulated_app
from epd_engine.emulate.costs import EmulatedCosts
from epd_engine.emulate.drain import drain_emulated
from epd_engine.emulate.engine import EmulationError
from epd_engine.engine import startup


def emulated_settings(args: argparse.Namespace) -> EmulatedSettings:
    """What ``serve``'s flags mean for an emulated instance; a ``UserError`` naming the flag
    for what it cannot honour."""
    model: Path | None = args.model
    if model is not None and (model / "config.json").exists():
        raise UserError(
            f"--emulate does not load checkpoints: {model} is a checkpoint directory; give "
            "--model a name (or leave it out), or drop --emulate to serve the real model"
        )
    role = Role(args.role)
    if role is not Role.EPD and not args.router_url:
        raise UserError(
            f"--emulate --role {role.value} needs --router-url: an instance that runs only "
            "some stages hands requests on through the router's table of instances"
        )
    if args.router_url and not internal_token_set():
        raise UserError(
            "--router-url needs the deployment's secret in EPD_INTERNAL_TOKEN (the same as the "
            "router's)"
        )
    try:
        costs = EmulatedCosts.load(args.emulate)
    except (OSError, ValueError) as exc:
        raise UserError(f"--emulate {args.emulate}: {exc}") from exc
    # --served-model-name as for a real instance (what `epdctl up` passes), else --model
    name = args.served_model_name or (str(model) if model is not None else None)
    name = name or costs.model.meta.get("model", {}).get("name")
    budgets = None
    if args.token_budget is not None or args.image_budget is not None:
        if args.token_budget is None or args.image_budget is None:
            raise UserError("--emulate takes --token-budget and --image-budget together")
        budgets = Budgets(image_budget=args.image_budget, token_budget=args.token_budget)
    return EmulatedSettings(
        costs=costs,
        model_name=name or "model",
        role=role,
        pool=args.pool,
        slo=SLO(ttft_s=args.slo_ttft, tpot_s=args.slo_tpot),
        budgets=budgets,
        router_url=",".join(args.router_url) if args.router_url else None,
        advertise_url=args.advertise_url or f"http://{args.host}:{args.port}",
        instance_id=args.instance_id or "",
    )


def run_emulated(args: argparse.Namespace) -> int:
    import uvicorn

    startup.mark("imports")
    setup_logging(args.log_level)
    try:
        app = create_emulated_app(emulated_settings(args))
    except EmulationError as exc:
        raise UserError(str(exc)) from exc
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_keep_alive=IDLE_KEEP_ALIVE_S,
    )
    # SIGTERM (a pod scaled away): leave routing and finish what it holds first
    server = DrainingServer(
        config, lambda: drain_emulated(getattr(app.state, "emulated", None), args.drain_timeout)
    )
    server.run()
    return 0
