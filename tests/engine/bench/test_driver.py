from __future__ import annotations

import base64
import io
import statistics

import pytest
from PIL import Image

from epd_engine.bench.driver import DriverConfig, replay
from epd_engine.config import SLO
from epd_engine.contracts.trace import ImageRef, TraceRecord
from epd_engine.slo.outcomes import summarize
from epd_engine.workload.arrivals import with_arrivals
from tests.engine.bench.fake_openai import FakeOpenAI


def record(i: int, arrival_s: float = 0.0, output_tokens: int = 6, images: int = 1) -> TraceRecord:
    refs = tuple(
        ImageRef(tokens=576, hash=f"img-{i}-{k}", width=64 + 8 * k, height=48)
        for k in range(images)
    )
    return TraceRecord(
        request_id=f"r{i}", arrival_s=arrival_s, prompt_tokens=10, images=refs,
        output_tokens=output_tokens,
    )  # fmt: skip


def config(server: FakeOpenAI, **kw: object) -> DriverConfig:
    return DriverConfig(endpoint=server.url, model="fake-model", progress=False, **kw)  # type: ignore[arg-type]


def within(value: float | None, floor: float, late_s: float) -> bool:
    """``value`` is no earlier than the server made it (less a clock tick) and at most
    ``late_s`` later: a loaded host delays the server's sleeps and the client's reads (the
    Kubernetes tests run beside these), never advances them."""
    return value is not None and floor - 0.01 <= value <= floor + late_s


def test_measures_ttft_and_every_gap(fake_openai: FakeOpenAI) -> None:
    fake_openai.behaviour.first_token_delay_s = 0.2
    fake_openai.behaviour.token_interval_s = 0.05
    records = [record(i, arrival_s=0.05 * i) for i in range(3)]
    results = replay(records, config(fake_openai))
    for r in results:
        assert r.ok, r.error
        assert within(r.ttft_s, 0.2, late_s=0.5), r.ttft_s
        assert len(r.itl_s) == 5  # 6 tokens, 5 gaps; the empty role chunk is not a token
        assert within(statistics.median(r.itl_s), 0.05, late_s=0.1), r.itl_s
        assert within(r.e2e_s, 0.2 + 5 * 0.05, late_s=1.0), r.e2e_s
        # the first token, then every gap: together the whole answer, at any load
        assert (r.ttft_s or 0.0) + sum(r.itl_s) == pytest.approx(r.e2e_s, abs=0.05)
        assert r.num_output_tokens == 6
    # Open loop: sends follow the trace's arrival times (in order, none early).
    sent = [r.arrival_s for r in results]
    assert sent == sorted(sent)
    assert all(within(s, at, late_s=0.2) for s, at in zip(sent, [0.0, 0.05, 0.1], strict=True))
    summary = summarize(results, SLO(ttft_s=2.0, tpot_s=0.5))  # late only on a broken run
    assert summary.attainment == 1.0
    assert within(summary.tpot.mean_s, 0.05, late_s=0.1)


def test_requests_reach_the_server_as_sent(fake_openai: FakeOpenAI) -> None:
    records = [
        record(0, output_tokens=7, images=2),
        TraceRecord(request_id="t", arrival_s=0.0, prompt_tokens=5, output_tokens=3),
        record(1, output_tokens=4, images=1).model_copy(
            update={"images": (ImageRef(tokens=576, hash="img-0-0", width=64, height=48),)}
        ),
    ]
    replay(records, config(fake_openai))
    by_tokens = {body["max_tokens"]: body for body in fake_openai.requests}
    assert set(by_tokens) == {7, 4, 3}
    for body in fake_openai.requests:
        assert body["stream"] is True and body["ignore_eos"] is True
        assert body["model"] == "fake-model"
    assert isinstance(by_tokens[3]["messages"][0]["content"], str)  # text-only: plain string
    assert len(by_tokens[3]["messages"][0]["content"].split()) == 5
    parts = by_tokens[7]["messages"][0]["content"]
    urls = [p["image_url"]["url"] for p in parts if p["type"] == "image_url"]
    assert len(urls) == 2 and [p["type"] for p in parts][-1] == "text"
    sizes = [Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1]))).size for u in urls]
    assert sizes == [(64, 48), (72, 48)]
    # Same hash, same picture, byte for byte (so encoder-cache reuse is real).
    reused = by_tokens[4]["messages"][0]["content"][0]["image_url"]["url"]
    assert reused == urls[0]


def test_errors_are_counted_not_raised(fake_openai: FakeOpenAI) -> None:
    fake_openai.behaviour.fail_max_tokens = 9
    fake_openai.behaviour.drop_max_tokens = 8
    records = [record(0), record(1, output_tokens=9), record(2, output_tokens=8), record(3)]
    results = replay(records, config(fake_openai))
    by_id = {r.request_id: r for r in results}
    assert by_id["r0"].ok and by_id["r3"].ok
    assert not by_id["r1"].ok and "InternalServerError" in (by_id["r1"].error or "")
    assert not by_id["r2"].ok and by_id["r2"].num_output_tokens == 2  # cut mid-stream
    summary = summarize(results, SLO(ttft_s=5.0, tpot_s=1.0))  # the errors are the misses
    assert summary.num_errors == 2 and summary.attainment == 0.5
    assert summary.num_short_outputs == 0


def test_unreachable_endpoint_gives_errors() -> None:
    cfg = DriverConfig(endpoint="http://127.0.0.1:9/v1", model="m", progress=False)
    results = replay([record(0), record(1)], cfg)
    assert all(not r.ok and "Connection" in (r.error or "") for r in results)


def test_time_bound_and_concurrency_bound(fake_openai: FakeOpenAI) -> None:
    fake_openai.behaviour.first_token_delay_s = 0.3
    records = with_arrivals([record(i) for i in range(3)], [0.0, 0.0, 5.0])
    results = replay(records, config(fake_openai, max_duration_s=0.6))
    assert results[0].ok and results[1].ok
    assert results[2].error is not None and "time limit" in results[2].error
    # One request at a time: the second waits for the first, and the lag is recorded.
    serial = replay([record(i) for i in range(2)], config(fake_openai, max_concurrency=1))
    assert serial[1].send_delay_s == pytest.approx(serial[0].e2e_s, abs=0.1)


def test_stage_timings_reported_by_the_server_are_kept(fake_openai: FakeOpenAI) -> None:
    fake_openai.behaviour.stage_s = {"encode": 0.01, "prefill": 0.02, "decode": 0.03}
    (result,) = replay([record(0)], config(fake_openai))
    assert result.stage_s == {"encode": 0.01, "prefill": 0.02, "decode": 0.03}
    assert summarize([result]).stage_mean_s["prefill"] == pytest.approx(0.02)
    measured = result.to_trace_record(record(0))
    assert measured.ttft_s == result.ttft_s and measured.tpot_s == result.itl_s


def test_results_follow_input_order_and_payloads_are_reusable(fake_openai: FakeOpenAI) -> None:
    from epd_engine.bench.driver import prepare_messages

    records = [record(0, arrival_s=0.2), record(1, arrival_s=0.0)]
    messages = prepare_messages(records)
    results = replay(records, config(fake_openai), messages)
    assert [r.request_id for r in results] == ["r0", "r1"]
    anonymous = [r.model_copy(update={"request_id": None}) for r in records]
    assert [r.request_id for r in replay(anonymous, config(fake_openai))] == [
        "req-000000", "req-000001"
    ]  # fmt: skip
    assert results[1].arrival_s < results[0].arrival_s  # r1 was sent first
    with pytest.raises(ValueError, match="1 messages for 2 records"):
        replay(records, config(fake_openai), messages[:1])
