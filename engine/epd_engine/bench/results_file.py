"""How every benchmark writes its results: a summary JSON, raw per-request data apart.

The summary holds every aggregate figure and a ``metadata`` block (commit, machine, date,
command); it is what ``benchmarks/results/`` keeps in git. Raw per-request data (each
request's timings, each answer, /metrics scrapes) go to ``raw/<stem>.json.gz`` beside the
summary, as compact gzip JSON, named by the summary's ``raw_file``. ``raw/`` folders are
git-ignored under ``benchmarks/results/``: a raw file that a cited figure needs is committed
on purpose (``git add -f``), see ``benchmarks/README.md``. ``read_results`` puts the raw keys
back, so readers see one dict as before the split.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import gzip
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

RAW_DIR = "raw"
RAW_FILE_KEY = "raw_file"  # in a summary: its raw file, relative to the summary's folder
RAW_MISSING_KEY = "raw_missing"  # set by read_results when that file is not here


def raw_path(path: str | Path) -> Path:
    """Where the raw data of the summary at ``path`` go."""
    path = Path(path)
    return path.parent / RAW_DIR / f"{path.stem}.json.gz"


def git_commit(cwd: str | Path | None = None) -> tuple[str | None, bool | None]:
    """(HEAD's commit, whether tracked files differ from it); (None, None) outside git."""
    cwd = cwd or Path(__file__).parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True,
                              text=True, timeout=5).stdout.strip()  # fmt: skip
        if not head:
            return None, None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                cwd=cwd, capture_output=True, text=True, timeout=20)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None, None
    return head, bool(status.stdout.strip()) if status.returncode == 0 else None


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def command_line() -> str:
    """This process's command as one would type it (``epdctl …`` or ``python -m …``)."""
    if Path(sys.argv[0]).name == "epdctl":
        return shlex.join(["epdctl", *sys.argv[1:]])
    return shlex.join(["python", *sys.orig_argv[1:]])


def _gpu() -> str | None:
    torch = sys.modules.get("torch")  # only when the benchmark loaded it: no import here
    with contextlib.suppress(Exception):
        if torch is not None and torch.cuda.is_available():
            return str(torch.cuda.get_device_name(0))
    return None


def run_metadata(command: str | Sequence[str] | None = None) -> dict[str, Any]:
    """Commit, machine, date and command of the run writing results now."""
    commit, dirty = git_commit()
    if command is not None and not isinstance(command, str):
        command = shlex.join(command)
    return {
        "commit": commit,
        "tree_dirty": dirty,
        "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": command or command_line(),
        "machine": {
            "host": platform.node(),
            "platform": platform.platform(),
            "cpu": cpu_model(),
            "cpu_count": os.cpu_count(),
            "gpu": _gpu(),
            "load_avg": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(),
        },
    }


def write_results(
    path: str | Path,
    summary: Mapping[str, Any],
    raw: Mapping[str, Any] | None = None,
    *,
    command: str | Sequence[str] | None = None,
    metadata: bool = True,
    indent: int | None = 2,
) -> Path:
    """Write ``summary`` (plus ``metadata`` unless it has one, and the raw file's name) to
    ``path``, and ``raw`` to ``raw_path(path)`` as compact gzip JSON. Returns ``path``."""
    path = Path(path)
    out = {k: v for k, v in summary.items() if k not in (RAW_FILE_KEY, RAW_MISSING_KEY)}
    if metadata and "metadata" not in out:
        out["metadata"] = run_metadata(command)
    if raw:
        write_raw(raw_path(path), raw)
        out[RAW_FILE_KEY] = f"{RAW_DIR}/{raw_path(path).name}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=indent) + "\n", encoding="utf-8")
    return path


def write_raw(path: Path, raw: Mapping[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(raw, separators=(",", ":")).encode()
    # mtime 0: the same data give the same bytes (no churn in git when re-converted)
    path.write_bytes(gzip.compress(data, compresslevel=9, mtime=0))
    return path


def read_results(path: str | Path) -> dict[str, Any]:
    """A summary with its raw keys put back; when its raw file is absent (not committed, or
    a copied summary), ``raw_missing`` names the file instead. Raises OSError / ValueError."""
    path = Path(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    if RAW_FILE_KEY not in data:
        return data
    raw_file = path.parent / data.pop(RAW_FILE_KEY)
    try:
        raw = json.loads(gzip.decompress(raw_file.read_bytes()))
    except FileNotFoundError:
        data[RAW_MISSING_KEY] = str(raw_file)
        return data
    except (OSError, EOFError, json.JSONDecodeError) as exc:
        raise ValueError(f"{raw_file}: not a readable raw results file ({exc})") from exc
    return {**data, **raw}


def round_floats(data: Any, digits: int = 9) -> Any:
    """Every float rounded to ``digits`` decimals (9: the ns of perf_counter timings; digits
    past it are float noise that gzip cannot compress). For committed raw files only."""
    if isinstance(data, float):
        return round(data, digits)
    if isinstance(data, list):
        return [round_floats(x, digits) for x in data]
    if isinstance(data, dict):
        return {k: round_floats(v, digits) for k, v in data.items()}
    return data
