"""The layout's rules (DESIGN.md §3) hold: ``lint-imports`` checks the import-linter contracts
in pyproject.toml (no torch in the shared vocabulary, scheduler, caches, profiler, workloads,
SLO math or router; the instance and router apps apart; the worker fed only by a
SchedulerOutput; only ``epdctl``'s commands import the operator; no drill or dev-only client in
the shipped packages). They replace the hand-written "imports no torch" probes, which checked
two packages and only the modules they happened to import.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_layout_contracts_are_kept() -> None:
    lint_imports = Path(sys.executable).with_name("lint-imports")
    run = subprocess.run(
        [str(lint_imports), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout
