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
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from epd_engine.config import SLO
from epd_engine.slo.goodput import GoodputResult, RatePoint
from epd_engine.slo.outcomes import BenchSummary, RequestResult

REPORT_KIND = "epd-bench"
REPORT_VERSION = 1


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
        **(extra or {}),
    }


def write_report(report: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return path


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
    """Read a report; ValueError with the file name when it is not one."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable JSON report ({exc})") from exc
    if not isinstance(data, dict) or data.get("kind") != REPORT_KIND:
        raise ValueError(f"{path}: not an epd-bench report (missing kind={REPORT_KIND!r})")
    if data.get("version") != REPORT_VERSION:
        raise ValueError(f"{path}: report version {data.get('version')} unsupported")
    return data


def attainment_curve(report: dict[str, Any]) -> list[tuple[float, float]]:
    """(rate, attainment) points of a report, for ``plots.plot_attainment``."""
    return [(float(p["rate_rps"]), float(p["attainment"])) for p in report.get("points", [])]


def results_from_report(report: dict[str, Any]) -> list[RequestResult]:
    """Per-request results back as ``RequestResult`` (for CDF plots across reports)."""
    return _results(report.get("requests", []))


def results_by_rate(report: dict[str, Any]) -> dict[float, list[RequestResult]]:
    """Every measured rate's results of a sweep / goodput report ({} for older reports)."""
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
