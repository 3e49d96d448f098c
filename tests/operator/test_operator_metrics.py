"""The operator's own metrics, scraped over HTTP from the server it starts."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from epd_engine.local.ports import free_port
from epd_operator.kube import operator_metrics as m


def scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def test_reconciles_decisions_planner_time_and_one_rollout_phase_per_object() -> None:
    port = free_port()
    m.serve(port)
    m.RECONCILES.labels("ns", "llava", "ok").inc()
    m.DECISIONS.labels("ns", "llava", "KeptCurrentPlan").inc()
    m.PLANNER_SECONDS.labels("ns", "llava").observe(1.5)
    m.set_phase("ns", "llava", "WaitingForPools")
    m.set_phase("ns", "llava", "Draining")
    got = scrape(port)
    who = (("name", "llava"), ("namespace", "ns"))
    assert got["epd_operator_reconciles_total"][(*who, ("outcome", "ok"))] >= 1
    decisions = got["epd_operator_plan_decisions_total"]
    assert decisions[(("name", "llava"), ("namespace", "ns"), ("reason", "KeptCurrentPlan"))] >= 1
    assert got["epd_operator_planner_seconds_count"][who] >= 1
    phases = {dict(k)["phase"]: v for k, v in got["epd_operator_rollout_phase"].items()
              if dict(k)["name"] == "llava"}  # fmt: skip
    assert phases == {"Draining": 1.0}  # the earlier phase's series is gone
