"""``epdctl up / down / status``: run an EPDDeployment locally as processes."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

from epd_engine.cli import UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    up = subparsers.add_parser("up", help="run an EPDDeployment manifest locally (router + pools)")
    up.add_argument("-f", "--file", required=True, type=Path, help="EPDDeployment manifest")
    up.add_argument("--plan", type=Path, help="plan JSON (from `epdctl plan`) for mode Auto")
    up.add_argument("--port", type=int, default=8080, help="router port on 127.0.0.1")
    up.add_argument("--model-dir", type=Path, help="checkpoint directory (overrides the source)")
    up.add_argument("--models-dir", type=Path, default=Path("models"), help="where presets go")
    up.add_argument("--runs-dir", type=Path, default=Path("runs"), help="logs, trace, state")
    up.add_argument("--device", default="cpu", help="cpu, or cuda for local GPUs")
    up.add_argument("--timeout", type=float, default=300, help="seconds to wait for readiness")
    up.add_argument("--detach", action="store_true", help="return once ready (stop: epdctl down)")
    up.set_defaults(func=run_up)

    down = subparsers.add_parser("down", help="stop a system started by `epdctl up`")
    down.add_argument("name", nargs="?", help="deployment name (default: the only one running)")
    down.add_argument("--runs-dir", type=Path, default=Path("runs"))
    down.set_defaults(func=run_down)

    status = subparsers.add_parser("status", help="pools and instances of a running system")
    status.add_argument("name", nargs="?")
    status.add_argument("--runs-dir", type=Path, default=Path("runs"))
    status.set_defaults(func=run_status)


def _load(args: argparse.Namespace):
    from epd_engine.plan import Plan
    from epd_operator.spec import EPDDeployment, ManifestError, fixed_plan

    try:
        deployment = EPDDeployment.from_yaml(args.file)
    except (ManifestError, OSError) as exc:
        raise UserError(str(exc)) from exc
    spec = deployment.spec
    if args.plan is not None:
        try:
            plan = Plan.model_validate_json(args.plan.read_text())
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot read plan {args.plan}: {exc}") from exc
    elif spec.disaggregation.mode == "Fixed":
        plan = fixed_plan(spec)
    else:
        raise UserError(
            f"{args.file}: disaggregation.mode is Auto; run `epdctl plan` on a trace and pass "
            "--plan plan.json, or set mode: Fixed with a method and pools"
        )
    return deployment, plan


def _model_dir(args: argparse.Namespace, deployment) -> Path:
    if args.model_dir is not None:
        return Path(args.model_dir)
    source = deployment.spec.model.source
    if source.host_path is not None:
        return Path(source.host_path.path)
    if source.preset is not None:
        target = args.models_dir / deployment.spec.model.name
        if not (target / "config.json").exists():
            from epd_engine.model.make_model import make_model

            print(f"making random-weight {source.preset} checkpoint in {target}")
            make_model(source.preset, target, seed=0, dtype="float32", show_progress=True)
        return target
    raise UserError("model.source.pvc exists only in a cluster; pass --model-dir for a local run")


def run_up(args: argparse.Namespace) -> int:
    from epd_engine.launcher import LaunchSpec, LocalSystem

    deployment, plan = _load(args)
    spec = deployment.spec
    slo = spec.slo.to_slo()
    launch = LaunchSpec(
        name=deployment.name,
        model_name=spec.model.name,
        model_dir=_model_dir(args, deployment),
        plan=plan,
        router_port=args.port,
        run_dir=args.runs_dir / deployment.name,
        slo_ttft_s=slo.ttft_s,
        slo_tpot_s=slo.tpot_s,
        dtype="float32" if args.device == "cpu" else spec.model.dtype,
        device=args.device,
        engine_args=[
            "--kv-block-size",
            str(spec.engine.kv_block_size),
            "--num-kv-blocks",
            str(spec.engine.num_kv_blocks),
            "--num-image-blocks",
            str(spec.engine.num_image_blocks),
            "--transfer-backend",
            spec.engine.transfer_backend,
            *spec.engine.extra_args,
        ],
    )
    system = LocalSystem(launch)
    print(f"starting {plan.describe()} for {spec.model.name} (logs in {launch.run_dir / 'logs'})")
    system.start()
    try:
        system.wait_ready(
            args.timeout,
            on_progress=lambda n, want: print(f"  instances ready: {n}/{want}", flush=True),
        )
    except (RuntimeError, TimeoutError) as exc:
        system.stop()
        raise UserError(str(exc)) from exc
    except KeyboardInterrupt:
        system.stop()
        return 130
    print(f"ready: OpenAI endpoint {launch.router_url}/v1  (model {spec.model.name!r})")
    print(f"       metrics {launch.router_url}/metrics, trace {launch.router_url}/v1/trace")
    if args.detach:
        _detach(system)
        return 0
    print("Ctrl-C stops everything.")
    stopping = False

    def _terminate(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _terminate)
    try:
        while not stopping:
            for process in system.dead():
                print(f"warning: {process.name} exited ({process.log})", file=sys.stderr)
                system.processes.remove(process)
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    print("stopping...")
    system.stop()
    return 0


def _detach(system) -> None:
    """Leave the children running; `epdctl down` finds them through state.json."""
    state = system.spec.run_dir / "state.json"
    data = json.loads(state.read_text())
    data["pids"] = [p.popen.pid for p in system.processes]
    data["pid"] = None
    state.write_text(json.dumps(data, indent=2))


def _find(args: argparse.Namespace) -> tuple[str, dict]:
    from epd_engine.launcher import read_state

    runs = Path(args.runs_dir)
    names = (
        [args.name]
        if args.name
        else [p.name for p in runs.glob("*") if (p / "state.json").exists()]
    )
    states = {n: read_state(runs / n) for n in names}
    states = {n: s for n, s in states.items() if s is not None}
    if not states:
        raise UserError(f"no running system found under {runs}/")
    if len(states) > 1:
        raise UserError(f"several systems are running ({', '.join(states)}); name one")
    name, state = next(iter(states.items()))
    return name, state  # type: ignore[return-value]


def run_down(args: argparse.Namespace) -> int:
    name, state = _find(args)
    if state.get("pid"):  # a foreground `epdctl up`: it stops its children in order
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(state["pid"]), signal.SIGTERM)
    else:  # detached: stop each child's process group
        for pid in state.get("pids", []):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(pid), signal.SIGINT)
        (Path(args.runs_dir) / name / "state.json").unlink(missing_ok=True)
    print(f"stopping {name}")
    return 0


def run_status(args: argparse.Namespace) -> int:
    import httpx

    from epd_engine.config import internal_token

    name, state = _find(args)
    url = state["router_url"]
    try:
        pools = httpx.get(
            f"{url}/internal/pools", headers={"X-EPD-Token": internal_token()}, timeout=3
        ).json()
    except httpx.HTTPError as exc:
        raise UserError(f"router {url} does not answer: {exc}") from exc
    print(f"{name}: {url}/v1")
    print(f"{'POOL':<24}{'ROLE':<6}{'INSTANCES':>10}{'IN-FLIGHT':>11}  ACTIVE")
    for pool, info in sorted(pools["pools"].items()):
        active = "yes" if info["active"] else "draining"
        count = len(info["instances"])
        print(f"{pool:<24}{info['role']:<6}{count:>10}{info['inflight']:>11}  {active}")
    return 0
