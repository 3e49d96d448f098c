"""``epdctl apply -f MANIFEST``: change a running local deployment of the same name (as
``kubectl apply`` does); its ``epdctl up`` converges to it through the rollout state machine.

The running ``up`` (started for ``mode: Auto``, or with ``--reconcile``) re-reads
``runs/<name>/manifest.yaml`` every pass; this command checks the new manifest, writes it
there, and with ``--wait`` follows the state file until the new spec's rollout completes.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from epd_engine.cli import UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("apply", help="change a running `epdctl up` deployment")
    p.add_argument("-f", "--file", required=True, type=Path, help="EPDDeployment manifest")
    p.add_argument("--runs-dir", type=Path, default=Path("runs"))
    p.add_argument("--wait", action="store_true", help="until the new spec's rollout completes")
    p.add_argument("--timeout", type=float, default=600, help="seconds --wait waits")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from epd_engine.local.state_file import read_state
    from epd_operator.api.spec import EPDDeployment, ManifestError
    from epd_operator.local.run import MANIFEST, write_manifest

    try:
        deployment = EPDDeployment.from_yaml(args.file)
    except (ManifestError, OSError) as exc:
        raise UserError(str(exc)) from exc
    run_dir = args.runs_dir / deployment.name
    state = read_state(run_dir)
    if state is None:
        raise UserError(
            f"no running deployment {deployment.name!r} under {args.runs_dir}/; start it with "
            f"`epdctl up -f {args.file}`"
        )
    if not state.get("reconcile"):
        raise UserError(
            f"{deployment.name} runs one fixed plan without the reconcile loop (a benchmark's "
            "static system); restart it with `epdctl up` to change it at run time"
        )
    generation = write_manifest(run_dir / MANIFEST, args.file.read_text())
    print(f"{deployment.name}: applied (generation {generation})", flush=True)
    if not args.wait:
        return 0
    deadline = time.monotonic() + args.timeout
    last = ""
    while time.monotonic() < deadline:
        state = read_state(run_dir)
        if state is None:
            raise UserError(f"{deployment.name} stopped")
        status = state.get("status") or {}
        line = f"  {status.get('plan', '?')}: {status.get('phase', '?')}"
        if line != last:
            print(line, flush=True)
            last = line
        if state.get("observed_generation") == generation and status.get("phase") == (
            "RolloutComplete"
        ):
            return 0
        if state.get("spec_error"):
            raise UserError(f"the running deployment refused the manifest: {state['spec_error']}")
        time.sleep(0.5)
    raise UserError(f"not converged after {args.timeout:.0f}s (last: {last.strip()})")
