"""What a local engine start costs, started afresh and forked from the zygote, in one run.

Each start is one tiny-llava ``epdctl serve`` from spawn to ``/health/ready``, one at a time,
alternating the two ways so the host's load falls on both alike. Reported: the child's own
CPU seconds and wall seconds to ready; the first forked start, which waits for the zygote
itself (paid once per launcher, not per engine), is reported apart.

    make bench-engine-start   # -> benchmarks/results/engine-start-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from benchmarks.bench_emulate_start import cpu_s, rss_mib
from epd_engine.bench.disagg_bench import wait_http_ready
from epd_engine.bench.results_file import write_results
from epd_engine.local import spawn
from epd_engine.local.ports import free_port


def one_start(model: Path, forked: bool, log: Path) -> dict[str, float]:
    """Spawn to ready: the child's wall and CPU seconds, then its RSS."""
    os.environ["EPD_ZYGOTE"] = "1" if forked else "0"
    port = free_port()
    args = ["serve", "--model", str(model), "--port", str(port), "--log-level", "warning"]
    started = time.monotonic()
    with log.open("ab") as out:
        child = spawn.spawn_epdctl(args, out, dict(os.environ))
    if forked != isinstance(child, spawn.ZygoteChild):
        raise RuntimeError(f"asked for {'a fork' if forked else 'a fresh start'}, got {child!r}")
    try:
        wait_http_ready(child, f"http://127.0.0.1:{port}/health/ready", log, 300, poll_s=0.05)
        wall = time.monotonic() - started
        return {"wall_s": wall, "cpu_s": cpu_s(child.pid), "rss_mib": rss_mib(child.pid)}
    finally:
        child.terminate()
        child.wait(30)


def summary(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="tiny-llava checkpoint dir")
    parser.add_argument("--runs", type=int, default=5, help="starts of each kind")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--log", type=Path, default=Path("/tmp/bench-engine-start.log"))
    args = parser.parse_args()
    first = one_start(args.model, True, args.log)  # starts the zygote too: reported apart
    fresh, forked = [], []
    for i in range(args.runs):
        fresh.append(one_start(args.model, False, args.log))
        forked.append(one_start(args.model, True, args.log))
        print(f"run {i + 1}/{args.runs}: fresh {fresh[-1]}  forked {forked[-1]}", flush=True)
    result = {
        "what": "tiny-llava `epdctl serve` on CPU, spawn -> /health/ready, one at a time, "
        "started afresh vs forked from the zygote (epd_engine/local/zygote.py)",
        "runs": args.runs,
        "fresh": {k: summary([r[k] for r in fresh]) for k in ("cpu_s", "wall_s", "rss_mib")},
        "forked": {k: summary([r[k] for r in forked]) for k in ("cpu_s", "wall_s", "rss_mib")},
        "forked_over_fresh_cpu": round(
            statistics.median(r["cpu_s"] for r in forked)
            / statistics.median(r["cpu_s"] for r in fresh),
            3,
        ),
        "first_forked_start_with_the_zygotes_own": {k: round(v, 3) for k, v in first.items()},
        "note": "RSS of a forked engine counts the pages it shares with the zygote",
    }
    write_results(args.out, result, command="python -m benchmarks.bench_engine_start")
    print(json.dumps({k: result[k] for k in ("fresh", "forked", "forked_over_fresh_cpu")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
