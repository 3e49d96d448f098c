"""``epdctl bench`` and the OpenAI surface against a real local system: the router and one EPD
instance as processes serving the tiny checkpoint, driven by the real ``openai`` client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import httpx
import openai
import pytest

from epd_engine.bench.driver import DriverConfig, replay
from epd_engine.bench.payloads import prompt_text
from epd_engine.bench.static_system import LaunchSpec, LocalSystem
from epd_engine.bench.token_prompts import TokenExactPrompts
from epd_engine.cli import main
from epd_engine.config import Method, internal_token
from epd_engine.contracts.trace import ImageRef, TraceRecord, parse_trace, write_trace
from epd_engine.local.ports import free_port
from epd_engine.slo.outcomes import summarize
from tests.engine.bench.peer_aiperf import (
    AIPERF_VERSION,
    aiperf_bin,
    replay_with_aiperf,
    run_aiperf,
)
from tests.engine.disagg.systems import ENGINE_ARGS, plan_for

pytestmark = pytest.mark.slow
IMAGE_TOKENS = 16  # the tiny checkpoint's image_seq_length
INTERNAL = {"X-EPD-Token": internal_token()}  # the trace is internal


@dataclass
class System:
    router: str  # base URL, no /v1
    instance: str
    model_dir: Path


@pytest.fixture(scope="module")
def system(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    spec = LaunchSpec(
        name="bench", model_name="tiny-llava", model_dir=tiny_model_dir,
        plan=plan_for(Method.EPD, {}), router_port=free_port(),
        run_dir=tmp_path_factory.mktemp("system"), engine_args=ENGINE_ARGS,
    )  # fmt: skip
    local = LocalSystem(spec)
    planned = local.start()
    try:
        local.wait_ready(timeout_s=240)
        yield System(spec.router_url, f"http://127.0.0.1:{planned[0].port}", tiny_model_dir)
    finally:
        local.stop()


def trace(n: int) -> list[TraceRecord]:
    """Mixed lengths, text-only and with one or two (partly repeated) images."""
    out = []
    for i in range(n):
        images = tuple(
            ImageRef(tokens=IMAGE_TOKENS, hash=f"pic-{(i + k) % 3}", width=64 + 8 * k, height=48)
            for k in range(i % 3)
        )
        out.append(TraceRecord(request_id=f"exact-{i}", arrival_s=0.05 * i,
                               prompt_tokens=[25, 61, 140, 33][i % 4] + 2 * (i % 3),
                               images=images, output_tokens=3 + i % 4))  # fmt: skip
    return out


def bench_config(system: System, **kw: object) -> DriverConfig:
    return DriverConfig(endpoint=f"{system.router}/v1", model="tiny-llava", progress=False, **kw)  # type: ignore[arg-type]


def router_trace(system: System, ids_from: float) -> list[TraceRecord]:
    text = httpx.get(
        f"{system.router}/v1/trace", params={"since": ids_from}, headers=INTERNAL, timeout=10
    ).text
    return parse_trace(text.splitlines())


def test_word_prompts_miss_the_token_count_the_trace_asks_for(system: System) -> None:
    """The defect: lengths were words, not tokens (about 2.4 tokens a word here)."""
    tokenizer = TokenExactPrompts.from_model_dir(system.model_dir).tokenizer
    text = prompt_text(100, "seed")
    assert len(tokenizer.encode(text, add_special_tokens=False)) > 150


@pytest.mark.parametrize("mode", ["template", "content"])
def test_bench_prompts_are_token_exact_and_checked_against_usage(system: System, mode: str) -> None:
    prompts = TokenExactPrompts.from_model_dir(system.model_dir, mode)  # type: ignore[arg-type]
    records = trace(8)
    results = replay(records, bench_config(system, prompts=prompts))
    summary = summarize(results)
    assert summary.num_ok == len(records), summary.errors
    assert summary.num_prompt_mismatches == 0
    assert summary.num_output_mismatches == 0
    for record, result in zip(records, results, strict=True):
        if mode == "template":  # the server's count is the trace's, images added
            assert result.server_prompt_tokens == record.prompt_tokens + record.image_tokens
        else:  # the user text alone has the count; the template comes on top
            assert (result.server_prompt_tokens or 0) > record.prompt_tokens + record.image_tokens
        assert result.num_output_tokens == record.output_tokens


def test_replaying_the_routers_trace_reproduces_it(system: System) -> None:
    """Recorded prompt tokens include the chat template; a template-mode replay sends exactly
    that many, with the recorded images (same hashes, sizes) and output lengths."""
    clock = float(
        httpx.get(f"{system.router}/v1/trace", headers=INTERNAL, timeout=10).headers[
            "X-EPD-Trace-Clock-S"
        ]
    )
    prompts = TokenExactPrompts.from_model_dir(system.model_dir)
    first = replay(trace(6), bench_config(system, prompts=prompts))
    assert all(r.ok for r in first)
    recorded = sorted(router_trace(system, clock), key=lambda r: r.prompt_tokens)  # all differ
    assert len(recorded) == 6
    clock = float(
        httpx.get(f"{system.router}/v1/trace", headers=INTERNAL, timeout=10).headers[
            "X-EPD-Trace-Clock-S"
        ]
    )
    again = replay(recorded, bench_config(system, prompts=prompts))
    assert summarize(again).num_prompt_mismatches == 0
    replayed = sorted(router_trace(system, clock), key=lambda r: r.prompt_tokens)
    key = lambda r: (r.prompt_tokens, r.output_tokens, [(i.width, i.height) for i in r.images])  # noqa: E731
    assert list(map(key, replayed)) == list(map(key, recorded))
    # identical pictures for identical hashes: the replay's pictures are new bytes, but
    # reused exactly where the recording reused one (a one-to-one map of content hashes)
    pairs = {(a.hash, b.hash) for r, s in zip(recorded, replayed, strict=True)
             for a, b in zip(r.images, s.images, strict=True)}  # fmt: skip
    assert len(pairs) == len({a for a, _ in pairs}) == len({b for _, b in pairs}) == 3


def clients(system: System) -> list[openai.OpenAI]:
    return [openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
            for url in (system.instance, system.router)]  # fmt: skip


def test_completions_with_a_string_or_token_ids(system: System) -> None:
    for client in clients(system):
        text = client.completions.create(
            model="tiny-llava", prompt="the cat sat on", max_tokens=5, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert text.object == "text_completion"
        assert text.choices[0].finish_reason == "length"
        assert text.usage is not None and text.usage.completion_tokens == 5
        assert text.system_fingerprint
        ids = client.completions.create(
            model="tiny-llava", prompt=[1, 86, 278, 223, 359], max_tokens=4, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert ids.usage is not None and ids.usage.prompt_tokens == 5
        stream = client.completions.create(
            model="tiny-llava", prompt="the cat sat on", max_tokens=5, temperature=0,
            stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert streamed == text.choices[0].text


def test_completions_refuse_batches_and_bad_token_ids(system: System) -> None:
    for client in clients(system):
        with pytest.raises(openai.BadRequestError, match="one prompt per request"):
            client.completions.create(model="tiny-llava", prompt=["a", "b"], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        clients(system)[0].completions.create(model="tiny-llava", prompt=[5, 99999], max_tokens=2)


def raw_events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_chunks_carry_nulls_fingerprint_and_continuous_usage(system: System) -> None:
    """OpenAI sends finish_reason/logprobs null until set and usage null on every chunk with
    include_usage; continuous_usage_stats (vLLM) puts running counts on each chunk."""
    body = {
        "model": "tiny-llava", "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 6, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    for url in (system.instance, system.router):
        events = raw_events(url, body)
        *with_choices, last = events
        for event in with_choices:
            assert event["system_fingerprint"]
            assert event["usage"] is None
            choice = event["choices"][0]
            assert "logprobs" in choice and choice["logprobs"] is None
            assert "finish_reason" in choice
        assert [e["choices"][0]["finish_reason"] for e in with_choices][-1] == "length"
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        running = raw_events(url, body)
        counts = [e["usage"]["completion_tokens"] for e in running]
        assert counts == sorted(counts) and counts[-1] == 6
        assert all(e["usage"]["prompt_tokens"] == last["usage"]["prompt_tokens"] for e in running)
        body["stream_options"] = {"include_usage": True}


def test_bench_records_the_cached_prompt_tokens_the_server_reports(system: System) -> None:
    """One at a time: a picture seen before is served from the encoder cache (and the KV
    pages up to it from the prefix cache), and each result carries that request's
    ``cached_tokens``; the summary adds them up."""

    def image(name: str) -> ImageRef:
        return ImageRef(tokens=IMAGE_TOKENS, hash=f"cached-{name}", width=40, height=40)

    shapes = [(image("a"),), (image("a"),), (image("a"), image("b")), ()]
    records = [
        TraceRecord(
            request_id=f"cached-{i}",
            arrival_s=0.01 * i,
            prompt_tokens=30,
            images=images,
            output_tokens=3,
        )
        for i, images in enumerate(shapes)
    ]
    prompts = TokenExactPrompts.from_model_dir(system.model_dir)
    results = replay(records, bench_config(system, prompts=prompts, max_concurrency=1))
    assert all(r.ok for r in results), [r.error for r in results]
    cached = [r.server_cached_tokens or 0 for r in results]
    # the image's tokens, and the prefix cache's pages before it (the template's first tokens)
    assert cached[0] == 0 and cached[3] == 0
    assert IMAGE_TOKENS <= cached[1] == cached[2] < IMAGE_TOKENS + 16
    assert summarize(results).cached_prompt_tokens == sum(cached)


def test_multi_turn_sessions_carry_the_conversation_to_the_server(system: System) -> None:
    """A later turn's prompt is the whole conversation: the server counts the earlier
    turn's prompt, its reply and the new message."""
    picture = (ImageRef(tokens=IMAGE_TOKENS, hash="turns", width=40, height=40),)
    records = [
        TraceRecord(
            request_id=f"{s}-{k}",
            arrival_s=0.01 * k,
            prompt_tokens=40 + 10 * k,
            images=picture if k == 0 and s == "a" else (),
            output_tokens=4,
            session_id=s,
        )
        for s in ("a", "b")
        for k in range(3)
    ]
    prompts = TokenExactPrompts.from_model_dir(system.model_dir)
    results = {r.request_id: r for r in replay(records, bench_config(system, prompts=prompts))}
    assert all(r.ok for r in results.values()), [r.error for r in results.values()]
    assert summarize(list(results.values())).num_prompt_mismatches == 0
    for s in ("a", "b"):
        first = results[f"{s}-0"]
        assert first.server_prompt_tokens == first.expected_prompt_tokens
        for k in (1, 2):
            before, now = results[f"{s}-{k - 1}"], results[f"{s}-{k}"]
            assert now.expected_prompt_tokens is None  # the history depends on the replies
            assert (now.server_prompt_tokens or 0) > (before.server_prompt_tokens or 0) + 4


def test_aiperf_runs_clean_and_agrees_with_the_routers_trace(
    system: System, tmp_path: Path
) -> None:
    """The peer check: AIPerf (PyPI) drives the router with no errors, and its medians agree
    with the router's own trace of the same requests. Tolerance: TTFT within 50 ms + 50% of
    the router's (the client adds connection and parsing time on this shared machine), mean
    inter-token latency within 10 ms + 50% (AIPerf measures client-side, where a chunk can
    carry several tokens)."""
    binary = aiperf_bin()
    if binary is None:
        pytest.skip(f"cannot install aiperf=={AIPERF_VERSION} (needs uv and PyPI)")
    clock = float(
        httpx.get(f"{system.router}/v1/trace", headers=INTERNAL, timeout=10).headers[
            "X-EPD-Trace-Clock-S"
        ]
    )
    aggregate, records = run_aiperf(
        binary, system.router, system.model_dir, tmp_path / "aiperf", requests=12, warmup=2
    )
    assert not aggregate.get("error_summary"), aggregate.get("error_summary")
    assert aggregate["request_count"]["avg"] == 12 and len(records) == 12
    assert all(r["metrics"]["usage_completion_tokens"]["value"] == 8 for r in records)
    traced = sorted(router_trace(system, clock), key=lambda r: r.arrival_s)[2:]  # no warm-up
    assert len(traced) == 12
    peer_ttft = median(r["metrics"]["time_to_first_token"]["value"] / 1000 for r in records)
    peer_itl = median(r["metrics"]["inter_token_latency"]["value"] / 1000 for r in records)
    our_ttft = median(r.ttft_s or 0.0 for r in traced)
    our_itl = median(sum(r.tpot_s) / len(r.tpot_s) for r in traced if isinstance(r.tpot_s, tuple))
    assert abs(peer_ttft - our_ttft) <= 0.05 + 0.5 * our_ttft, (peer_ttft, our_ttft)
    assert abs(peer_itl - our_itl) <= 0.01 + 0.5 * our_itl, (peer_itl, our_itl)


def test_aiperf_replays_our_exported_prompt_texts_token_exact(
    system: System, tmp_path: Path
) -> None:
    """``epdctl trace convert --to mooncake --tokenizer``: AIPerf sends our prompts as they
    are, so the router sees the trace's prompt and output tokens exactly."""
    binary = aiperf_bin()
    if binary is None:
        pytest.skip(f"cannot install aiperf=={AIPERF_VERSION} (needs uv and PyPI)")
    records = [
        TraceRecord(request_id=f"peer-{i}", arrival_s=0.2 * i, prompt_tokens=n, output_tokens=4)
        for i, n in enumerate((30, 45, 60, 75))
    ]
    ours = write_trace(records, tmp_path / "ours.jsonl")
    texts = tmp_path / "texts.jsonl"
    assert main(["trace", "convert", str(ours), "--to", "mooncake",
                 "--tokenizer", str(system.model_dir), "-o", str(texts)]) == 0  # fmt: skip
    clock = float(
        httpx.get(f"{system.router}/v1/trace", headers=INTERNAL, timeout=10).headers[
            "X-EPD-Trace-Clock-S"
        ]
    )
    done = replay_with_aiperf(binary, system.router, system.model_dir, texts, tmp_path / "ap")
    assert len(done) == 4 and not any(r.get("error") for r in done)
    traced = router_trace(system, clock)
    assert sorted(r.prompt_tokens for r in traced) == [30, 45, 60, 75]
    assert [r.output_tokens for r in traced] == [4] * 4
