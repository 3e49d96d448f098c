"""A run's mean step phases, read from a real registry's exposition text (what a bench
scrapes from an instance's ``/metrics`` before and after its run)."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from epd_engine.bench.server_metrics import difference, parse_samples, step_phase_means
from epd_engine.metrics import Metrics


def scrape(metrics: Metrics) -> dict[str, dict[str, float]]:
    return {"samples": parse_samples(generate_latest(metrics.registry).decode())}


def observe(metrics: Metrics, step: str, phase: str, seconds: float) -> None:
    metrics.step_phase.labels(**metrics.labels, phase=phase, step=step).observe(seconds)


def test_means_cover_only_the_run_between_the_scrapes() -> None:
    metrics = Metrics("m", "EPD", "epd")
    observe(metrics, "decode", "launch", 5.0)  # before the run: not its time
    before = scrape(metrics)
    for seconds in (0.001, 0.003):
        observe(metrics, "decode", "launch", seconds)
        observe(metrics, "decode", "wait", 2 * seconds)
    observe(metrics, "mixed", "launch", 0.050)
    means = step_phase_means(difference(before, scrape(metrics)))
    assert means["decode"]["steps"] == 2
    assert means["decode"]["ms"] == {"launch": pytest.approx(2.0), "wait": pytest.approx(4.0)}
    assert means["mixed"] == {"steps": 1, "ms": {"launch": pytest.approx(50.0)}}


def test_a_server_without_the_metric_gives_nothing() -> None:
    assert step_phase_means({"epd_batch_tokens_sum": 3.0}) == {}
