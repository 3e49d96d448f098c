"""One sweep report out of several single-rate reports of the same deployment.

``bench_fidelity.py --interleave`` measures rate by rate, every method at a rate before the
next rate, so that the host's drift over the run (hours apart, the same configuration's
p90 TTFT moved by 20%) falls between rates, not between the calibrating method and the
held-out ones. Each method then gets the report a ``--sweep`` of all rates would have
written: its points, every rate's requests, and the goodput of the sweep (the highest rate
passing below the lowest failing one).
"""

from __future__ import annotations

from typing import Any


def merge_sweeps(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """``reports``: single- or multi-rate sweep reports of one deployment and trace."""
    if not reports:
        raise ValueError("no reports to merge")
    points = sorted((p for r in reports for p in r["points"]), key=lambda p: p["rate_rps"])
    rates = [float(p["rate_rps"]) for p in points]
    if len(set(rates)) != len(rates):
        raise ValueError(f"a rate is measured twice: {rates}")
    failing = [float(p["rate_rps"]) for p in points if not p["passed"]]
    lowest_failing = min(failing) if failing else None
    passing = [r for r in rates if lowest_failing is None or r < lowest_failing]
    goodput = max(passing) if passing else 0.0
    by_rate: dict[str, Any] = {}
    for report in reports:
        by_rate.update(report.get("requests_by_rate") or {})
    # the goodput rate's report holds its requests and summary, as a sweep's would
    holder = next(
        (r for r in reports if any(float(p["rate_rps"]) == goodput for p in r["points"])),
        reports[-1],
    )
    return {
        **holder,
        "created_at": min(r.get("created_at", "") for r in reports),
        "points": points,
        "goodput_rps": goodput,
        "lowest_failing_rps": lowest_failing,
        "requests_by_rate": dict(sorted(by_rate.items(), key=lambda item: float(item[0]))),
        "merged_from": [r.get("created_at") for r in reports],
    }
