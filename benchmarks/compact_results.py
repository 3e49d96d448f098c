"""Turn committed results that still hold raw per-request data into summary + raw file.

``python -m benchmarks.compact_results [PATHS]`` (default: every JSON under
``benchmarks/results``): an ``epdctl bench`` report keeps its aggregates in place and moves
``requests`` / ``requests_by_rate`` / ``server_metrics`` to ``raw/<name>.json.gz`` beside it
(``report.split_report``, as ``write_report`` does for new runs); a switch drill's
``answers`` go the same way. Raw floats keep 9 decimals (1 ns: the timings' clock
resolution). Each file is read back and compared with the original before the next, and
every report's per-rate p50/p90/p99 are recomputed from its raw requests and checked against
its summary. Idempotent: a file that names a raw file already is only checked.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from epd_engine.bench.report import (
    REPORT_KIND,
    has_requests,
    load_report,
    results_by_rate,
    results_from_report,
    split_report,
)
from epd_engine.bench.results_file import (
    RAW_DIR,
    RAW_FILE_KEY,
    read_results,
    round_floats,
    write_results,
)
from epd_engine.config import SLO
from epd_engine.slo.outcomes import summarize

RESULTS = Path("benchmarks/results")
RAW_ANSWERS = "answers"  # switch_drill: every answer's text, times and error


def split(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(summary, raw) of a results file with raw data in it, else None."""
    if data.get("kind") == REPORT_KIND:
        return split_report(data)
    if isinstance(data.get(RAW_ANSWERS), list):
        return {k: v for k, v in data.items() if k != RAW_ANSWERS}, {RAW_ANSWERS: data[RAW_ANSWERS]}
    return None


def close(a: Any, b: Any, abs_s: float = 1e-9) -> bool:
    """Equal, floats within ``abs_s`` (default 1 ns: the raw files' rounding)."""
    if isinstance(a, float) or isinstance(b, float):
        numbers = isinstance(a, int | float) and isinstance(b, int | float)
        return numbers and math.isclose(a, b, rel_tol=1e-9, abs_tol=abs_s)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k], abs_s) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y, abs_s) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def check_percentiles(path: Path) -> int:
    """Every rate's TTFT / TPOT / e2e percentiles recomputed from the raw requests agree
    with the summary; returns the number of points checked."""
    report = load_report(path)
    if not has_requests(report):
        return 0  # its raw file is not here: nothing to recompute from
    slo = SLO(**report["slo"])
    runs = {float(p["rate_rps"]): p["summary"] for p in report["points"] if p.get("summary")}
    checked = 0
    for rate, results in results_by_rate(report).items():
        if rate in runs:
            _compare(path, f"rate {rate:g}", summarize(results, slo).to_dict(), runs[rate])
            checked += 1
    if report.get("summary") and (results := results_from_report(report)):
        _compare(path, "main run", summarize(results, slo).to_dict(), report["summary"])
        checked += 1
    return checked


# Reports have always stored inter-token gaps in microseconds (RequestResult.to_dict), so
# what derives from them (TPOT, ITL) is recomputed to 1 us, TTFT and e2e to 1 ns.
TOLERANCE_S = {"ttft": 1e-9, "e2e": 1e-9, "tpot": 1e-6, "tpot_p90": 1e-6, "itl": 1e-6}


def _compare(path: Path, what: str, again: dict[str, Any], stored: dict[str, Any]) -> None:
    for metric, abs_s in TOLERANCE_S.items():
        for key in ("p50_s", "p90_s", "p99_s", "mean_s"):
            a, b = again.get(metric, {}).get(key), stored.get(metric, {}).get(key)
            if b is not None and not close(a, b, abs_s):
                raise SystemExit(f"{path} {what}: {metric} {key} {a} from raw vs {b} stored")


def compact(path: Path) -> tuple[int, int] | None:
    """Split ``path`` if it holds raw data; (bytes before, bytes after) or None."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or RAW_FILE_KEY in data:
        return None
    parts = split(data)
    if parts is None or not parts[1]:
        return None
    summary, raw = parts
    before = path.stat().st_size
    write_results(path, summary, round_floats(raw), metadata=False)
    reread = load_report(path) if data.get("kind") == REPORT_KIND else read_results(path)
    if not close(reread, data):
        raise SystemExit(f"{path}: the summary + raw file do not read back as the original")
    raw_bytes = (path.parent / RAW_DIR / f"{path.stem}.json.gz").stat().st_size
    return before, path.stat().st_size + raw_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, help=f"default: {RESULTS}/**/*.json")
    args = parser.parse_args(argv)
    paths = args.paths or sorted(p for p in RESULTS.rglob("*.json") if RAW_DIR not in p.parts)
    total_before = total_after = points = 0
    for path in paths:
        sizes = compact(path)
        if sizes:
            total_before += sizes[0]
            total_after += sizes[1]
            print(f"{path}: {sizes[0]:,} -> {sizes[1]:,} bytes (summary + raw)")
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and data.get("kind") == REPORT_KIND:
            points += check_percentiles(path)
    print(f"compacted {total_before:,} -> {total_after:,} bytes; {points} runs' percentiles "
          "recomputed from raw requests match their summaries")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
