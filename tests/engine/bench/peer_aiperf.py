"""NVIDIA AIPerf (from PyPI) in its own virtual environment under ``.build/``: it pulls in
~800 MB of dependencies we do not want in the project's lock."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

AIPERF_VERSION = "0.13.0"
VENV = Path(__file__).parents[3] / ".build" / f"peer-aiperf-{AIPERF_VERSION}"


def aiperf_bin() -> Path | None:
    """The ``aiperf`` executable, installed on first use; None when it cannot be installed
    (no ``uv`` or no network): the caller skips, saying why."""
    binary = VENV / "bin" / "aiperf"
    if binary.exists():
        return binary
    uv = shutil.which("uv")
    if uv is None:
        return None
    try:
        subprocess.run([uv, "venv", "-q", "-p", "3.11", str(VENV)], check=True, timeout=120)
        subprocess.run([uv, "pip", "install", "-q", "-p", str(VENV / "bin" / "python"),
                        f"aiperf=={AIPERF_VERSION}"], check=True, timeout=600)  # fmt: skip
    except (subprocess.SubprocessError, OSError):
        shutil.rmtree(VENV, ignore_errors=True)
        return None
    return binary if binary.exists() else None


def run_aiperf(
    binary: Path, url: str, tokenizer: Path, out: Path, *, requests: int, warmup: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A small closed-loop chat run; (aggregate JSON, measured per-request records)."""
    args = [
        str(binary), "profile", "-m", "tiny-llava", "--url", url, "--endpoint-type", "chat",
        "--streaming", "--concurrency", "2", "--request-count", str(requests),
        "--warmup-request-count", str(warmup), "--isl", "40", "--osl", "8",
        "--tokenizer", str(tokenizer), "--extra-inputs", "ignore_eos:true",
        "--extra-inputs", "min_tokens:8", "--use-server-token-count", "--ui", "none",
        "--random-seed", "0", "--artifact-dir", str(out),
    ]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=400)
    if done.returncode != 0:
        raise AssertionError(f"aiperf failed ({done.returncode}):\n{done.stdout[-3000:]}")
    aggregate = json.loads((out / "profile_export_aiperf.json").read_text())
    lines = (out / "profile_export.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    measured = [r for r in records if r["metadata"].get("benchmark_phase") == "profiling"]
    return aggregate, measured


def replay_with_aiperf(
    binary: Path, url: str, tokenizer: Path, trace: Path, out: Path
) -> list[dict[str, Any]]:
    """AIPerf replays a Mooncake-style file on its timestamps (``--fixed-schedule``), with
    no end-of-sequence so every row gets its ``output_length``; its per-request records."""
    args = [
        str(binary), "profile", "-m", "tiny-llava", "--url", url, "--endpoint-type", "chat",
        "--streaming", "--input-file", str(trace), "--custom-dataset-type", "mooncake_trace",
        "--fixed-schedule", "--tokenizer", str(tokenizer), "--extra-inputs", "ignore_eos:true",
        "--use-server-token-count", "--ui", "none", "--artifact-dir", str(out),
    ]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=400)
    if done.returncode != 0:
        raise AssertionError(f"aiperf failed ({done.returncode}):\n{done.stdout[-3000:]}")
    lines = (out / "profile_export.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]
