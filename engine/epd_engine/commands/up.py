"""``epdctl up / down / status``: run an EPDDeployment locally as processes."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

from epd_engine.cli import UserError
from epd_engine.local.state_file import read_state, remove_state, state_path


def register(subparsers: argparse._SubParsersAction) -> None:
    up = subparsers.add_parser("up", help="run an EPDDeployment manifest locally (router + pools)")
    up.add_argument("-f", "--file", required=True, type=Path, help="EPDDeployment manifest")
    up.add_argument("--plan", type=Path, help="plan JSON (from `epdctl plan`) for mode Auto")
    up.add_argument(
        "--cost-model",
        type=Path,
        help="cost model JSON (from `epdctl profile-costs`) the reconcile loop plans with; "
        "default: the built-in reference (LLaVA-1.5-7B on an H800-class GPU)",
    )
    up.add_argument("--port", type=int, default=8080, help="router port on 127.0.0.1")
    up.add_argument("--model-dir", type=Path, help="checkpoint directory (overrides the source)")
    up.add_argument("--models-dir", type=Path, default=Path("models"), help="where presets go")
    up.add_argument("--runs-dir", type=Path, default=Path("runs"), help="logs, trace, state")
    up.add_argument("--device", default="cpu", help="cpu, or cuda for local GPUs")
    up.add_argument("--timeout", type=float, default=300, help="seconds to wait for readiness")
    up.add_argument("--detach", action="store_true", help="return once ready (stop: epdctl down)")
    up.add_argument(
        "--reconcile",
        action="store_true",
        help="run the reconcile loop for a Fixed manifest too (`epdctl apply` changes it); "
        "mode Auto without --plan always runs it",
    )
    up.set_defaults(func=run_up)

    down = subparsers.add_parser("down", help="stop a system started by `epdctl up`")
    down.add_argument("name", nargs="?", help="deployment name (default: the only one running)")
    down.add_argument("--runs-dir", type=Path, default=Path("runs"))
    down.set_defaults(func=run_down)

    status = subparsers.add_parser("status", help="pools and instances of a running system")
    status.add_argument("name", nargs="?")
    status.add_argument("--runs-dir", type=Path, default=Path("runs"))
    status.set_defaults(func=run_status)


def _reconciled(args: argparse.Namespace, deployment) -> bool:
    auto = deployment.spec.disaggregation.mode == "Auto"
    return bool(args.reconcile) or (auto and args.plan is None)


def _load(args: argparse.Namespace):
    from epd_engine.contracts.plan import Plan
    from epd_operator.api.spec import EPDDeployment, ManifestError, fixed_plan

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
        plan = None  # the reconcile loop plans (Auto)
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
    from epd_operator.rollout.serve_settings import cache_settings

    deployment, plan = _load(args)
    if _reconciled(args, deployment):
        return _run_reconciled(args, deployment)
    if args.cost_model is not None:
        raise UserError(
            "--cost-model is for the reconcile loop's planner: it needs mode Auto without "
            "--plan, or --reconcile (this run serves one static plan)"
        )
    assert plan is not None
    spec = deployment.spec
    slo = spec.slo.to_slo()
    launch = LaunchSpec(
        name=deployment.name,
        model_name=spec.model.name,
        model_dir=_model_dir(args, deployment),
        plan=plan,
        router_port=args.port,
        router_replicas=spec.router.replicas,
        run_dir=args.runs_dir / deployment.name,
        slo_ttft_s=slo.ttft_s,
        slo_tpot_s=slo.tpot_s,
        slo_attainment=slo.attainment,
        dtype="float32" if args.device == "cpu" else spec.model.dtype,
        device=args.device,
        gpu_memory_fraction=spec.engine.gpu_memory_fraction,
        engine_args=[*cache_settings(spec), *spec.engine.extra_args],
    )
    if args.detach:
        return _detach(args, launch.run_dir)
    _refuse_or_clear_old_run(launch.run_dir)
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
    system.write_state(ready=True)
    print(f"ready: OpenAI endpoint {launch.router_url}/v1  (model {spec.model.name!r})")
    print(f"       metrics {launch.router_url}/metrics, trace {launch.router_url}/v1/trace")
    print(f"       internal token in {launch.run_dir / 'state.json'} (header X-EPD-Token)")
    print("Ctrl-C stops everything.", flush=True)
    stopping = False

    def _terminate(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _terminate)
    try:
        while not stopping:  # crashed children come back after a back-off
            for line in system.supervise():
                print(line, file=sys.stderr, flush=True)
            time.sleep(0.25)
    except KeyboardInterrupt:
        pass
    print("stopping...", flush=True)
    system.stop()
    return 0


def _run_reconciled(args: argparse.Namespace, deployment) -> int:
    """The reconcile loop on local processes (``epd_operator.local.run``): plans (Auto),
    rolls out, and follows `epdctl apply` until stopped."""
    from epd_operator.local.run import LocalRun, Options
    from epd_operator.planning.cost_file import cost_source

    run_dir = args.runs_dir / deployment.name
    if args.cost_model is not None:  # refuse a bad file before anything starts
        try:
            cost_source(args.cost_model)
        except ValueError as exc:
            raise UserError(f"--cost-model: {exc}") from exc
    if args.detach:
        return _detach(args, run_dir)
    _refuse_or_clear_old_run(run_dir)
    opts = Options(
        name=deployment.name,
        model_name=deployment.spec.model.name,
        model_dir=_model_dir(args, deployment),
        run_dir=run_dir,
        port=args.port,
        device=args.device,
        dtype="float32" if args.device == "cpu" else deployment.spec.model.dtype,
        timeout_s=args.timeout,
        cost_model=args.cost_model,
    )
    mode = deployment.spec.disaggregation.mode
    print(f"starting the reconcile loop ({mode}) for {deployment.spec.model.name}", flush=True)
    try:
        return LocalRun(opts, args.file.read_text()).run()
    except (RuntimeError, TimeoutError, ValueError, OSError) as exc:
        raise UserError(str(exc)) from exc


def _detach(args: argparse.Namespace, run_dir: Path) -> int:
    """Run this same `up` without ``--detach`` as a background supervisor (its own session,
    output in ``up.log``) and return once it reports ready; `epdctl down` stops it."""
    import subprocess

    _refuse_or_clear_old_run(run_dir)
    log = run_dir / "logs" / "up.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    argv = [a for a in sys.argv[1:] if a != "--detach"]
    with log.open("ab") as out:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "epd_engine", *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    deadline = time.monotonic() + args.timeout + 30
    while time.monotonic() < deadline:
        if supervisor.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise UserError(f"`epdctl up` exited with {supervisor.returncode}; {log}:\n{tail}")
        state = read_state(run_dir)
        if state and state.get("ready") and state.get("pid") == supervisor.pid:
            print(
                f"ready: OpenAI endpoint {state['router_url']}/v1 (supervisor pid {supervisor.pid})"
            )
            print(f"       logs in {run_dir / 'logs'}; stop with `epdctl down`")
            return 0
        time.sleep(0.3)
    _stop_run(run_dir)
    raise UserError(f"not ready after {args.timeout:.0f}s; see {log}")


def _is_ours(pid: int) -> bool:
    """``pid`` is alive and an `epdctl` process (not an unrelated one that reused the id)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"epd_engine" in cmdline or b"epdctl" in cmdline


def _refuse_or_clear_old_run(run_dir: Path) -> None:
    """One run per name: refuse while one is supervised; stop the leftovers of one that is
    not (a crashed `up`), so nothing of it joins the new run."""
    state = read_state(run_dir)
    if state is None:
        return
    pid = state.get("pid")
    if pid and pid != os.getpid() and _is_ours(int(pid)):
        raise UserError(f"{run_dir.name} is already running (pid {pid}); `epdctl down` first")
    _stop_run(run_dir)


def _stop_run(run_dir: Path, timeout_s: float = 20) -> None:
    """Stop a run: its supervisor stops the children in order; then every child's process
    group that is still there is killed."""
    state = read_state(run_dir) or {}
    pid = state.get("pid")
    if pid and _is_ours(int(pid)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while _is_ours(int(pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
    for child in state.get("pids", []):
        if _is_ours(int(child)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(child), signal.SIGKILL)
    remove_state(run_dir)


def _find(args: argparse.Namespace) -> tuple[str, dict]:
    runs = Path(args.runs_dir)
    names = [args.name] if args.name else [p.name for p in runs.glob("*") if state_path(p).exists()]
    states = {n: read_state(runs / n) for n in names}
    states = {n: s for n, s in states.items() if s is not None}
    if not states:
        raise UserError(f"no running system found under {runs}/")
    if len(states) > 1:
        raise UserError(f"several systems are running ({', '.join(states)}); name one")
    name, state = next(iter(states.items()))
    return name, state  # type: ignore[return-value]


def run_down(args: argparse.Namespace) -> int:
    name, _ = _find(args)
    print(f"stopping {name}", flush=True)
    _stop_run(Path(args.runs_dir) / name)
    return 0


def run_status(args: argparse.Namespace) -> int:
    import httpx

    name, state = _find(args)
    url = state["router_url"]
    try:
        pools = httpx.get(
            f"{url}/internal/pools", headers={"X-EPD-Token": state.get("token", "")}, timeout=3
        ).json()
    except httpx.HTTPError as exc:
        raise UserError(f"router {url} does not answer: {exc}") from exc
    print(f"{name}: {url}/v1")
    loop = state.get("status")
    if isinstance(loop, dict):  # the reconcile loop's last pass
        print(f"plan {loop.get('plan')} (revision {loop.get('revision')}, {loop.get('phase')})")
        print(f"  reason: {loop.get('reason')}")
        if loop.get("cost_model"):
            print(f"  the profiler plans with: {loop['cost_model']}")
    print(f"{'POOL':<24}{'ROLE':<6}{'INSTANCES':>10}{'IN-FLIGHT':>11}  ACTIVE")
    for pool, info in sorted(pools["pools"].items()):
        active = "yes" if info["active"] else "draining"
        count = len(info["instances"])
        print(f"{pool:<24}{info['role']:<6}{count:>10}{info['inflight']:>11}  {active}")
    return 0
