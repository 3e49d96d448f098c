"""The server's Prometheus ``/metrics`` captured before and after a run, for the report.

The endpoint is the API's base URL without ``/v1``. Both snapshots and their difference go
into the report: counters and histogram sums/counts grow by what the run did (requests,
tokens, cache hits), gauges show where they ended. Best effort: a server without ``/metrics``
gives an ``error`` entry, never a failed benchmark.
"""

from __future__ import annotations

import re
from typing import Any

Samples = dict[str, float]


def metrics_url(endpoint: str) -> str:
    base = endpoint.rstrip("/")
    return (base[: -len("/v1")] if base.endswith("/v1") else base) + "/metrics"


def parse_samples(text: str) -> Samples:
    """``name{label="v",...}`` -> value, for every sample of the exposition text."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def scrape(endpoint: str, api_key: str = "EMPTY", timeout_s: float = 10.0) -> dict[str, Any]:
    """``{"url", "samples"}`` or ``{"url", "error"}``."""
    import httpx

    url = metrics_url(endpoint)
    try:
        response = httpx.get(url, headers={"Authorization": f"Bearer {api_key}"}, timeout=timeout_s)
        response.raise_for_status()
        return {"url": url, "samples": parse_samples(response.text)}
    except (httpx.HTTPError, ValueError) as exc:
        return {"url": url, "error": f"{type(exc).__name__}: {exc}"[:200]}


def difference(before: dict[str, Any], after: dict[str, Any]) -> Samples:
    """After minus before for samples that changed (new ones count from zero)."""
    old, new = before.get("samples") or {}, after.get("samples") or {}
    return {
        name: value - old.get(name, 0.0)
        for name, value in new.items()
        if value != old.get(name, 0.0)
    }


def metrics_report(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    return {"before": before, "after": after, "delta": difference(before, after)}


def step_phase_means(delta: Samples) -> dict[str, dict[str, Any]]:
    """From a run's ``difference``: per step kind (``decode``, ``mixed``), how many steps
    ran and the mean milliseconds of each of their phases (``epd_step_phase_seconds``;
    ``step_phases.py``). Empty for a server that does not export them."""
    sums: dict[tuple[str, str], float] = {}
    counts: dict[tuple[str, str], float] = {}
    into = {"epd_step_phase_seconds_sum": sums, "epd_step_phase_seconds_count": counts}
    for name, value in delta.items():
        family, _, labels = name.partition("{")
        if family not in into:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        key = (found["step"], found["phase"])
        into[family][key] = into[family].get(key, 0.0) + value
    means: dict[str, dict[str, Any]] = {}
    for (step, phase), count in sorted(counts.items()):
        entry = means.setdefault(step, {"steps": 0, "ms": {}})
        entry["steps"] = max(entry["steps"], int(count))
        entry["ms"][phase] = 1000 * sums.get((step, phase), 0.0) / count
    return means
