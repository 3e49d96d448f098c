"""A live ``epdctl serve`` process driven by the real ``openai`` client."""

from __future__ import annotations

import asyncio
import re

import httpx
import openai
import pytest

from epd_engine.engine.step_phases import PHASES
from tests.engine.server.images import image_message

pytestmark = pytest.mark.slow


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_models_lists_served_name(instance_url: str) -> None:
    models = client(instance_url).models.list()
    assert [m.id for m in models.data] == ["tiny-llava"]


def test_chat_with_image_non_streaming_counts_usage(instance_url: str) -> None:
    response = client(instance_url).chat.completions.create(
        model="tiny-llava",
        messages=[image_message("What is in the picture?", 1)],  # type: ignore[list-item]
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "length"
    assert response.usage is not None
    assert response.usage.completion_tokens == 12
    assert response.usage.prompt_tokens > 16  # 16 image tokens plus the text
    assert choice.message.content


def test_streaming_matches_non_streaming_greedy(instance_url: str) -> None:
    c = client(instance_url)
    kwargs = dict(
        model="tiny-llava",
        messages=[image_message("Describe it.", 2)],
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = c.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    stream = c.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    )  # type: ignore[call-overload]
    text = []
    usage = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert "".join(text) == full.choices[0].message.content
    assert usage is not None and usage.completion_tokens == 10


def test_seeded_sampling_is_reproducible(instance_url: str) -> None:
    c = client(instance_url)
    kwargs = dict(
        model="tiny-llava",
        messages=[{"role": "user", "content": "tell me a story"}],
        max_tokens=12,
        temperature=1.0,
        top_p=0.9,
        seed=1234,
        extra_body={"ignore_eos": True},
    )
    a = c.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    b = c.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    assert a.choices[0].message.content == b.choices[0].message.content


def test_stop_string_truncates_output(instance_url: str) -> None:
    c = client(instance_url)
    base = dict(
        model="tiny-llava",
        messages=[{"role": "user", "content": "count"}],
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = c.chat.completions.create(**base).choices[0].message.content or ""  # type: ignore[call-overload]
    assert len(full) > 4
    stop = full[3:5]
    cut = c.chat.completions.create(stop=[stop], **base).choices[0]  # type: ignore[call-overload]
    assert cut.finish_reason == "stop"
    assert cut.message.content == full[: full.find(stop)]


async def test_concurrent_requests_are_batched(instance_url: str) -> None:
    aclient = openai.AsyncOpenAI(base_url=f"{instance_url}/v1", api_key="unused", max_retries=0)

    async def one(seed: int) -> int:
        r = await aclient.chat.completions.create(
            model="tiny-llava",
            messages=[image_message(f"request {seed}", seed)],  # type: ignore[list-item]
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert r.usage is not None
        return r.usage.completion_tokens

    counts = await asyncio.gather(*(one(s) for s in range(10, 16)))
    assert counts == [24] * 6
    metrics = httpx.get(f"{instance_url}/metrics").text
    # continuous batching: some iteration decoded several requests at once
    assert _largest_decode_batch(metrics) > 1
    assert 'outcome="success"' in metrics
    # every phase of the decode steps that served them is timed, the engine thread's hand-off
    # to the event loop (publish) included
    for phase in PHASES:
        assert _phase_count(metrics, phase, "decode") > 0, phase


def _phase_count(metrics: str, phase: str, step: str) -> float:
    for line in metrics.splitlines():
        if line.startswith("epd_step_phase_seconds_count{") and (
            f'phase="{phase}"' in line and f'step="{step}"' in line
        ):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _largest_decode_batch(metrics: str) -> float:
    """Lower bound of the largest decode batch: the biggest bucket bound some batch exceeded."""
    pattern = r'^epd_batch_decode_requests_bucket\{(?:[^}]*,)?le="([^"]+)"[^}]*\} (\S+)$'
    buckets = [(le, float(n)) for le, n in re.findall(pattern, metrics, re.M)]
    total = buckets[-1][1]
    exceeded = [float(le) for le, count in buckets if le != "+Inf" and count < total]
    return max(exceeded) if exceeded else 0.0


def test_metrics_expose_design_names(instance_url: str) -> None:
    text = httpx.get(f"{instance_url}/metrics").text
    for name in (
        "epd_request_ttft_seconds",
        "epd_request_tpot_seconds",
        "epd_stage_queue_seconds",
        "epd_stage_execution_seconds",
        "epd_batch_tokens",
        "epd_batch_decode_requests",
        "epd_step_phase_seconds",
        "epd_cache_usage_ratio",
        "epd_encoder_cache_hits_total",
        "epd_requests_total",
        "epd_slo_met_total",
    ):
        assert name in text, name


def test_the_instance_serves_with_its_startup_heap_frozen_and_counts_gc_pauses(
    instance_url: str,
) -> None:
    """A full collection walked its ~400,000 start-up objects mid-step (160-210 ms on the
    2-core host): ``epdctl serve`` now freezes them once ready (``gc_heap``)."""
    ready = httpx.get(f"{instance_url}/health/ready").json()
    assert ready["gc_frozen_objects"] > 100_000
    text = httpx.get(f"{instance_url}/metrics").text
    passes = re.search(r'epd_gc_pause_seconds_count\{.*generation="2".*\} (\S+)', text)
    assert passes is not None and float(passes[1]) >= 1  # the freeze's own collection
