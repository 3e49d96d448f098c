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
    up.add_argument(
        "--plan",
        type=Path,
        help="plan JSON (from `epdctl plan`): start on this plan, fixed, with its budgets "
        "(`epdctl apply` changes it later)",
    )
    up.add_argument(
        "--cost-model",
        type=Path,
        help="cost model JSON (from `epdctl profile-costs`) the reconcile loop plans with, or "
        "reference[:MODEL] (a built-in synthetic one); default: the built-in reference "
        "(LLaVA-1.5-7B on an H800-class GPU)",
    )
    up.add_argument(
        "--emulate",
        metavar="COST_MODEL",
        type=Path,
        help="run every instance emulated (`epdctl serve --emulate`): times from this cost "
        "model (a JSON file, or reference[:MODEL] for a built-in synthetic one), no torch, no "
        "weights, no checkpoint made; the model is served as NAME-emulated and the loop plans "
        "with this cost model unless --cost-model is given",
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
        help="no effect, kept for scripts: every run is the reconcile loop (a Fixed manifest "
        "is rolled out as it is, and `epdctl apply` changes it)",
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


def _load(args: argparse.Namespace):
    """The manifest, and with ``--plan`` the plan it starts on (Fixed at that plan)."""
    from epd_engine.contracts.plan import Plan
    from epd_operator.api.spec import EPDDeployment, ManifestError

    try:
        deployment = EPDDeployment.from_yaml(args.file)
    except (ManifestError, OSError) as exc:
        raise UserError(str(exc)) from exc
    if args.plan is None:
        return deployment, None
    try:
        plan = Plan.model_validate_json(args.plan.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read plan {args.plan}: {exc}") from exc
    return deployment, plan


def _manifest_text(args: argparse.Namespace, plan) -> str:
    """What the loop runs: the file as written, or, with ``--plan``, its EPDDeployment with
    the disaggregation fixed at the plan (a later ``epdctl apply`` changes it like any
    other)."""
    import yaml

    from epd_operator.api.spec import KIND, EPDDeployment, ManifestError

    text = args.file.read_text()
    if plan is None:
        return text
    doc = next(d for d in yaml.safe_load_all(text) if isinstance(d, dict) and d.get("kind") == KIND)
    doc["spec"]["disaggregation"] = {
        "mode": "Fixed",
        "method": plan.method.value,
        "pools": {role.value: count for role, count in plan.pools.items()},
    }
    try:
        EPDDeployment.from_dict(doc, f"{args.file} with plan {args.plan}")
    except ManifestError as exc:
        raise UserError(str(exc)) from exc
    return yaml.safe_dump(doc, sort_keys=False)


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
    """The reconcile loop on local processes (``epd_operator.local.run``): rolls the
    manifest out like the operator (a Fixed plan as written; Auto plans by itself), restarts
    what crashes, and follows `epdctl apply` until stopped."""
    from epd_operator.local.run import LocalRun, Options
    from epd_operator.planning.cost_file import cost_source

    deployment, plan = _load(args)
    manifest_text = _manifest_text(args, plan)
    run_dir = args.runs_dir / deployment.name
    if args.cost_model is not None:  # refuse a bad file before anything starts
        try:
            cost_source(args.cost_model)
        except ValueError as exc:
            raise UserError(f"--cost-model: {exc}") from exc
    if args.emulate is not None:
        _check_emulated_costs(args.emulate)
    if args.detach:
        return _detach(args, run_dir)
    _refuse_or_clear_old_run(run_dir)
    spec = deployment.spec
    emulate = args.emulate
    device = "cpu" if emulate is not None else args.device  # emulated: no GPU to place on
    opts = Options(
        name=deployment.name,
        model_name=spec.model.name,
        # emulated instances load nothing: no checkpoint is made or read
        model_dir=Path(spec.model.name) if emulate is not None else _model_dir(args, deployment),
        run_dir=run_dir,
        port=args.port,
        device=device,
        dtype="float32" if device == "cpu" else spec.model.dtype,
        timeout_s=args.timeout,
        cost_model=args.cost_model or emulate,
        plan_budgets=dict(plan.budgets) if plan is not None else {},
        emulate=emulate,
    )
    mode = "Fixed" if plan is not None else spec.disaggregation.mode
    name = opts.served_model_name
    print(f"starting {deployment.name} ({mode}) for {name} (logs in {run_dir / 'logs'})")
    try:
        return LocalRun(opts, manifest_text).run()
    except (RuntimeError, TimeoutError, ValueError, OSError) as exc:
        raise UserError(str(exc)) from exc


def _check_emulated_costs(path: Path) -> None:
    """``--emulate``: a cost model every emulated instance can run on, or a ``UserError``
    naming the flag and the file (before anything starts)."""
    from epd_engine.emulate.costs import EmulatedCosts

    try:
        EmulatedCosts.load(path)
    except (OSError, ValueError) as exc:
        raise UserError(f"--emulate {path}: {exc}") from exc


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
        if isinstance(loop.get("decision"), dict):  # why the last re-plan decided (Auto)
            from epd_operator.api.decision_status import PlanDecision
            from epd_operator.planning.decision import describe_decision

            print(f"  decision: {describe_decision(PlanDecision.model_validate(loop['decision']))}")
    print(f"{'POOL':<24}{'ROLE':<6}{'INSTANCES':>10}{'IN-FLIGHT':>11}  ACTIVE")
    for pool, info in sorted(pools["pools"].items()):
        active = "yes" if info["active"] else "draining"
        count = len(info["instances"])
        print(f"{pool:<24}{info['role']:<6}{count:>10}{info['inflight']:>11}  {active}")
    return 0
