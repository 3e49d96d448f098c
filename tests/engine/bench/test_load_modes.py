"""Closed loop, duration with grace, warm-up, per-request export and /metrics capture, against
the fake server (known latencies; see fake_openai.py for why)."""

from __future__ import annotations

import json
from pathlib import Path

from epd_engine.bench.closed_loop import closed_loop
from epd_engine.bench.driver import DriverConfig, replay
from epd_engine.bench.report import export_requests
from epd_engine.bench.server_metrics import difference, metrics_url, parse_samples
from epd_engine.contracts.trace import TraceRecord
from epd_engine.slo.outcomes import RequestResult
from tests.engine.bench.fake_openai import FakeOpenAI


def records(n: int, output_tokens: int = 4) -> list[TraceRecord]:
    return [
        TraceRecord(request_id=f"r{i}", arrival_s=10.0 * i, prompt_tokens=5,
                    output_tokens=output_tokens)
        for i in range(n)
    ]  # fmt: skip


def config(server: FakeOpenAI, **kw: object) -> DriverConfig:
    return DriverConfig(endpoint=server.url, model="fake-model", progress=False, **kw)  # type: ignore[arg-type]


def busy_at_once(results: list[RequestResult]) -> int:
    """Most requests in flight at one moment (from send times and latencies)."""
    edges = sorted([(r.arrival_s, 1) for r in results] + [(r.arrival_s + (r.e2e_s or 0.0), -1)
                                                          for r in results])  # fmt: skip
    busy = peak = 0
    for _, step in edges:
        busy += step
        peak = max(peak, busy)
    return peak


def test_closed_loop_ignores_arrivals_and_keeps_n_in_flight(fake_openai: FakeOpenAI) -> None:
    fake_openai.behaviour.first_token_delay_s = 0.05
    results = closed_loop(records(8), config(fake_openai), concurrency=2)
    assert len(results) == 8 and all(r.ok for r in results)
    # arrivals 10 s apart would take 70 s open loop; back to back it is well under a second
    assert max(r.arrival_s for r in results) < 2.0
    assert busy_at_once(results) == 2


def test_duration_cycles_the_trace_and_grace_cancels_stragglers(fake_openai: FakeOpenAI) -> None:
    fake_openai.behaviour.first_token_delay_s = 0.02
    results = closed_loop(records(3), config(fake_openai, duration_s=0.6, grace_s=5.0), 3)
    assert len(results) > 3  # the 3-request trace was cycled
    assert any(r.request_id.endswith("#1") for r in results)
    assert all(r.ok for r in results)
    assert max(r.arrival_s for r in results) <= 0.6 + 0.05
    # a straggler: 2 s responses with a 0.2 s grace are cancelled and recorded as errors
    fake_openai.behaviour.first_token_delay_s = 2.0
    cut = closed_loop(records(1), config(fake_openai, duration_s=0.1, grace_s=0.2), 1)
    assert len(cut) == 1 and cut[0].error is not None and cut[0].error.startswith("Cancelled")


def test_warm_up_requests_are_sent_but_not_measured(fake_openai: FakeOpenAI) -> None:
    results = replay(records(2, output_tokens=3), config(fake_openai, warmup_requests=3))
    assert len(fake_openai.requests) == 5
    assert [r.request_id for r in results] == ["r0", "r1"]


def test_open_loop_duration_drops_later_arrivals(fake_openai: FakeOpenAI) -> None:
    trace = [r.model_copy(update={"arrival_s": 0.1 * i}) for i, r in enumerate(records(10))]
    results = replay(trace, config(fake_openai, duration_s=0.35, grace_s=5.0))
    assert [r.request_id for r in results] == ["r0", "r1", "r2", "r3"]


def test_exact_outputs_send_min_tokens_with_max_tokens(fake_openai: FakeOpenAI) -> None:
    replay(records(1, output_tokens=7), config(fake_openai))
    sent = fake_openai.requests[0]
    assert (sent["max_tokens"], sent["min_tokens"], sent["ignore_eos"]) == (7, 7, True)


def test_per_request_jsonl_names_each_run(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    results = closed_loop(records(2), config(fake_openai), concurrency=1)
    path = export_requests(tmp_path / "r.jsonl", {1: results}, "concurrency")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(line["concurrency"], line["request_id"]) for line in lines] == [(1, "r0"), (1, "r1")]
    assert all(line["ttft_s"] > 0 for line in lines)


def test_metrics_snapshots_and_their_difference() -> None:
    before = parse_samples('epd_requests_total{outcome="success"} 3\nepd_running 2\n')
    after = parse_samples('epd_requests_total{outcome="success"} 10\nepd_running 2\n')
    delta = difference({"samples": before}, {"samples": after})
    assert delta == {'epd_requests_total{outcome="success"}': 7.0}
    assert metrics_url("http://h:8000/v1") == "http://h:8000/metrics"
