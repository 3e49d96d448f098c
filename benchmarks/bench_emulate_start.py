"""How fast an emulated instance starts and how much it holds (issue 32: <= 1 s, <= 100 MB),
beside a bare interpreter started the same way in the same run, so the host's load shows
in both; and started as `epdctl up --emulate` starts them, forked from their zygote.
Emulated figures say nothing of the engine's speed; this measures the stand-in.

    make bench-emulate-start   # 5 runs -> benchmarks/results/emulate-start-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from epd_engine.bench.disagg_bench import wait_http_ready
from epd_engine.local import spawn
from epd_engine.local.ports import free_port

REPO = Path(__file__).resolve().parents[1]
COST_MODEL = REPO / "benchmarks" / "results" / "cost-model-h200.json"
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def emulated_start(forked: bool = False) -> dict[str, float]:
    """One emulated instance from exec (or, ``forked``, from the fork of its zygote, as
    ``epdctl up --emulate`` starts them) to ready: wall and CPU seconds, then its RSS."""
    port = free_port()
    args = ["serve", "--emulate", str(COST_MODEL), "--port", str(port), "--log-level", "warning"]
    started = time.monotonic()
    proc: spawn.ChildProcess
    if forked:
        with open(os.devnull, "wb") as out:
            proc = spawn.spawn_epdctl(args, out, dict(os.environ))
        assert isinstance(proc, spawn.ZygoteChild), "no zygote: EPD_ZYGOTE=0?"
    else:
        command = [sys.executable, "-m", "epd_engine", *args]
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http_ready(proc, f"http://127.0.0.1:{port}/health/ready", None, 120, poll_s=0.02)
        wall = time.monotonic() - started
        return {"wall_s": wall, "cpu_s": cpu_s(proc.pid), "rss_mib": rss_mib(proc.pid)}
    finally:
        proc.terminate()
        proc.wait(10)


def bare_interpreter_cpu_s() -> float:
    """CPU seconds of ``python -c pass`` (the floor any Python process pays here)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(sum(os.times()[:2]))"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return float(done.stdout)


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    runs, bare, forked = [], [], []
    emulated_start(forked=True)  # starts the zygote (once per launcher): not counted
    for i in range(args.runs):
        runs.append(emulated_start())
        bare.append(bare_interpreter_cpu_s())
        forked.append(emulated_start(forked=True))
        print(f"run {i + 1}/{args.runs}: {runs[-1]}, forked {forked[-1]}", flush=True)
    result = {
        "what": "epdctl serve --emulate: exec to /health/ready, then RSS (an emulated "
        "instance: these figures are the stand-in's, never evidence of the engine's speed)",
        "cost_model": str(COST_MODEL.relative_to(REPO)),
        "runs": args.runs,
        "load_average_1m": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "start_wall_s": summary([r["wall_s"] for r in runs]),
        "start_cpu_s": summary([r["cpu_s"] for r in runs]),
        "rss_mib": summary([r["rss_mib"] for r in runs]),
        "bare_interpreter_cpu_s": summary(bare),
        "forked_from_the_zygote": {  # how `epdctl up --emulate` starts them (local/zygote.py)
            "start_wall_s": summary([r["wall_s"] for r in forked]),
            "start_cpu_s": summary([r["cpu_s"] for r in forked]),
            "rss_mib": summary([r["rss_mib"] for r in forked]),
        },
        "goal": {"start_s": 1.0, "rss_mib": 100},
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
        ).stdout.strip(),
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    shown = ("start_cpu_s", "start_wall_s", "rss_mib", "forked_from_the_zygote")
    print(json.dumps({k: result[k] for k in shown}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
