"""``runs/<name>/state.json``: what ``epdctl down``, ``status`` and ``apply`` read of a running
local system (the supervisor's pid, every child's pid, the router's URL and token, the last
status). It holds the deployment's token, so it is written private to its user, atomically.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

STATE_FILE = "state.json"


def state_path(run_dir: Path) -> Path:
    return run_dir / STATE_FILE


def read_state(run_dir: Path) -> dict[str, Any] | None:
    """The run's state, or None when it is missing, unreadable or not a JSON object."""
    try:
        data = json.loads(state_path(run_dir).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_private(path: Path, text: str) -> None:
    """Write ``text`` readable by its owner only, replacing ``path`` in one rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    tmp.replace(path)


def write_state(run_dir: Path, state: dict[str, Any]) -> None:
    write_private(state_path(run_dir), json.dumps(state, indent=2))


def remove_state(run_dir: Path) -> None:
    state_path(run_dir).unlink(missing_ok=True)
