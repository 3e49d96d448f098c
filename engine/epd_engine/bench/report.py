"""JSON results of ``epdctl bench`` (the simulator writes the same shape, so plots compare them).

Shape (version 1)::

    {"kind": "epd-bench", "version": 1, "label", "created_at", "endpoint", "model",
     "trace": {summarize_trace...}, "slo": {ttft_s, tpot_s, attainment}, "mode",
     "points": [{rate_rps, attainment, passed, summary}], "goodput_rps", "lowest_failing_rps",
     "summary": {...main run...}, "requests": [{...RequestResult...}],
     "requests_by_rate": {"<rate>": [{...RequestResult...}]},   (sweep / goodput modes)
     "concurrency_points": [{concurrency, summary}],            (concurrency mode)
     "workload": {how prompt and output lengths were built},
     "server_metrics": {"before", "after", "delta"}}             (the server's /metrics)

``write_report`` keeps the per-request keys (``requests``, ``requests_by_rate``,
``server_metrics``) out of the JSON, in its raw file (``results_file.py``: beside it, in
``raw/``; a sweep's ``requests``, one of its rates', stored once); ``load_report`` puts them back.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from epd_engine.bench.results_file import RAW_MISSING_KEY, read_results, write_results
from epd_engine.config import SLO
from epd_engine.emulate import EMULATED_NOTE, EMULATED_SUFFIX
from epd_engine.slo.goodput import GoodputResult, RatePoint
from epd_engine.slo.outcomes import BenchSummary, RequestResult

REPORT_KIND = "epd-bench"
REPORT_VERSION = 1
RAW_KEYS = ("requests", "requests_by_rate", "server_metrics")
REQUESTS_RATE_KEY = "requests_rate"  # in a raw file: `requests` are this rate's


def _point(point: RatePoint) -> dict[str, Any]:
    return {
        "rate_rps": point.rate_rps,
        "attainment": point.attainment,
        "passed": point.passed,
        "summary": point.summary.to_dict() if point.summary else None,
    }


def build_report(
    *,
    label: str,
    slo: SLO,
    trace: dict[str, Any],
    summary: BenchSummary | None,
    results: Sequence[RequestResult] = (),
    search: GoodputResult | None = None,
    mode: str = "single",
    endpoint: str = "",
    model: str = "",
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Assemble the report dict; ``search`` carries sweep/bisection points and the goodput."""
    return {
        "kind": REPORT_KIND,
        "version": REPORT_VERSION,
        "label": label,
        "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "endpoint": endpoint,
        "model": model,
        "mode": mode,
        "trace": trace,
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "attainment": slo.attainment},
        "points": [_point(p) for p in search.points] if search else [],
        "goodput_rps": search.goodput_rps if search else None,
        "lowest_failing_rps": search.lowest_failing_rps if search else None,
        "summary": summary.to_dict() if summary else None,
        "requests": [r.to_dict() for r in results],
        **emulated_marks(model),
        **(extra or {}),
    }


def emulated_marks(model: str) -> dict[str, Any]:
    """A report on an emulated deployment says so in its summary: its figures are the cost
    model's (an emulated instance answers only to a name ending in ``-emulated``)."""
    if not model.endswith(EMULATED_SUFFIX):
        return {}
    return {"emulated": True, "emulated_note": EMULATED_NOTE}


def split_report(report: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(summary, raw): the per-request keys apart; a sweep's ``requests`` stored once."""
    summary = {k: v for k, v in report.items() if k not in RAW_KEYS}
    raw = {k: report[k] for k in RAW_KEYS if report.get(k)}
    rate = next(
        (rate for rate, items in (raw.get("requests_by_rate") or {}).items()
         if raw.get("requests") and items == raw["requests"]),
        None,
    )  # fmt: skip
    if rate is not None:
        del raw["requests"]
        raw[REQUESTS_RATE_KEY] = rate
    return summary, raw


def write_report(report: dict[str, Any], path: str | Path) -> Path:
    """The summary to ``path``, the per-request keys to its raw file."""
    return write_results(path, *split_report(report))


def export_requests(
    path: str | Path, runs: Mapping[Any, Sequence[RequestResult]], key: str = "rate_rps"
) -> Path:
    """Every request's result as one JSON line; ``key`` names the run (rate or concurrency)
    each line belongs to (left out for a single run)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for run, results in runs.items():
            for result in results:
                line = result.to_dict() if run is None else {key: run, **result.to_dict()}
                out.write(json.dumps(line) + "\n")
    return path


def load_report(path: str | Path) -> dict[str, Any]:
    """Read a report (its raw file's keys put back, where it has one); ValueError with the file
    name when it is not one."""
    path = Path(path)
    try:
        data = read_results(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable JSON report ({exc})") from exc
    if not isinstance(data, dict) or data.get("kind") != REPORT_KIND:
        raise ValueError(f"{path}: not an epd-bench report (missing kind={REPORT_KIND!r})")
    if data.get("version") != REPORT_VERSION:
        raise ValueError(f"{path}: report version {data.get('version')} unsupported")
    rate = data.pop(REQUESTS_RATE_KEY, None)
    if rate is not None:
        data["requests"] = data["requests_by_rate"][rate]
    return data


def has_requests(report: dict[str, Any]) -> bool:
    """False for a summary whose raw file is not here (its per-request results with it)."""
    return RAW_MISSING_KEY not in report


def _require_requests(report: dict[str, Any]) -> None:
    if not has_requests(report):
        raise ValueError(
            f"report {report.get('label')!r}: its per-request results are in "
            f"{report[RAW_MISSING_KEY]}, which is not here (benchmarks/README.md: raw files)"
        )


def attainment_curve(report: dict[str, Any]) -> list[tuple[float, float]]:
    """(rate, attainment) points of a report, for ``plots.plot_attainment``."""
    return [(float(p["rate_rps"]), float(p["attainment"])) for p in report.get("points", [])]


def results_from_report(report: dict[str, Any]) -> list[RequestResult]:
    """Per-request results back as ``RequestResult`` (for CDF plots across reports)."""
    _require_requests(report)
    return _results(report.get("requests", []))


def results_by_rate(report: dict[str, Any]) -> dict[float, list[RequestResult]]:
    """Every measured rate's results of a sweep / goodput report ({} for older reports)."""
    _require_requests(report)
    by_rate = report.get("requests_by_rate") or {}
    return {float(rate): _results(items) for rate, items in sorted(by_rate.items())}


def _results(items: list[dict[str, Any]]) -> list[RequestResult]:
    out = []
    for item in items:
        data = dict(item)
        data["itl_s"] = tuple(data.get("itl_s") or ())
        if data.get("path") is not None:
            data["path"] = tuple(data["path"])
        out.append(RequestResult(**data))
    return out
