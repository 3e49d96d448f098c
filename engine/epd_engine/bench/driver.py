"""Async load driver: replays a trace against any OpenAI-compatible endpoint.

Open loop: each request is sent at its trace arrival time (bounded by ``max_concurrency``),
streamed with the real ``openai`` client, and measured client-side: TTFT (send → first content
chunk), every inter-token gap, end-to-end latency. Output lengths are fixed with ``max_tokens``
plus ``min_tokens`` and ``ignore_eos`` (HydraInfer records lengths once and replays them this
way); prompts have the record's exact token count when a tokenizer is given (``prompts``).
Errors are recorded per request, never raised; requests cut off by ``max_duration_s`` or left
in flight after ``duration_s + grace_s`` count as errors. Closed-loop runs: ``closed_loop``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from epd_engine.bench.payloads import Payload, chat_payload
from epd_engine.bench.token_prompts import TokenExactPrompts
from epd_engine.contracts.trace import TraceRecord, sort_by_arrival
from epd_engine.slo.outcomes import RequestResult
from epd_engine.workload.arrivals import at_rate
from epd_engine.workload.sessions import Turn, plan_turns

# Non-standard chunk field a server may use to report per-stage seconds (encode, prefill, ...).
STAGE_FIELD = "epd_stage_s"
PATH_FIELD = "epd_path"


@dataclass(frozen=True)
class DriverConfig:
    endpoint: str  # base URL incl. /v1, e.g. http://127.0.0.1:8000/v1
    model: str
    api_key: str = "EMPTY"
    max_concurrency: int = 256
    max_duration_s: float | None = None  # wall-clock bound for one run
    request_timeout_s: float = 600.0
    ignore_eos: bool = True
    image_format: str = "jpeg"
    extra_body: dict[str, Any] = field(default_factory=dict)
    progress: bool = True
    label: str = ""
    prompts: TokenExactPrompts | None = None  # exact prompt lengths (else words, approximate)
    block_tokens: int = 512  # tokens per ``hash_ids`` block
    exact_output: bool = True  # send min_tokens = max_tokens
    duration_s: float | None = None  # stop sending after this long, then wait ``grace_s``
    grace_s: float = 30.0
    warmup_requests: int = 0  # sent first, not measured

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError(f"duration must be > 0 s, got {self.duration_s}")
        if self.grace_s < 0 or self.warmup_requests < 0:
            raise ValueError("grace period and warm-up requests must be >= 0")
        if self.image_format not in ("jpeg", "png"):
            raise ValueError(f"image_format must be jpeg or png, got {self.image_format!r}")


def _error_text(exc: BaseException) -> str:
    message = str(exc).replace("\n", " ")[:200]
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _request_body(config: DriverConfig, record: TraceRecord) -> dict[str, Any]:
    """Fields beyond the standard ones: exact output lengths (vLLM's extensions)."""
    body: dict[str, Any] = {"ignore_eos": config.ignore_eos}
    if config.exact_output:
        body["min_tokens"] = record.output_tokens
    return {**body, **config.extra_body}


async def send_one(
    client: Any,
    config: DriverConfig,
    record: TraceRecord,
    payload: Payload,
    scheduled: float,
    limit: asyncio.Semaphore,
    t0: float,
    turn: Turn | None = None,
) -> RequestResult:
    """Send one request at ``scheduled`` (perf_counter) once ``limit`` allows; measure it.
    A session's ``turn`` also waits for the previous turn and sends the conversation so far."""
    await asyncio.sleep(max(0.0, scheduled - time.perf_counter()))
    messages, expected_prompt_tokens = payload.messages, payload.expected_prompt_tokens
    reply: list[str] = []
    if turn is not None:
        await turn.wait_previous()
        if turn.previous is not None:  # waiting for the last turn is the session, not lag
            scheduled = max(scheduled, time.perf_counter())
        messages = turn.history() + messages
        if turn.index > 0:  # the history's count depends on the replies
            expected_prompt_tokens = None
    try:
        return await _send(client, config, record, messages, scheduled, limit, t0,
                           expected_prompt_tokens, reply)  # fmt: skip
    finally:
        if turn is not None:
            turn.finish(payload.messages, "".join(reply))


async def _send(
    client: Any,
    config: DriverConfig,
    record: TraceRecord,
    messages: list[dict[str, Any]],
    scheduled: float,
    limit: asyncio.Semaphore,
    t0: float,
    expected_prompt_tokens: int | None,
    reply: list[str],
) -> RequestResult:
    async with limit:
        sent = time.perf_counter()
        token_times: list[float] = []
        usage_tokens: int | None = None
        server_prompt_tokens: int | None = None
        cached_tokens: int | None = None
        stage_s: dict[str, float] | None = None
        path: tuple[str, ...] | None = None
        error: str | None = None
        try:
            stream = await client.chat.completions.create(
                model=config.model,
                messages=messages,
                max_tokens=record.output_tokens,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=_request_body(config, record),
            )
            async for chunk in stream:
                now = time.perf_counter()
                if any(choice.delta and choice.delta.content for choice in chunk.choices):
                    token_times.append(now)
                    reply += [c.delta.content for c in chunk.choices if c.delta and c.delta.content]
                if chunk.usage is not None:
                    usage_tokens = chunk.usage.completion_tokens
                    server_prompt_tokens = chunk.usage.prompt_tokens
                    if (details := chunk.usage.prompt_tokens_details) is not None:
                        cached_tokens = details.cached_tokens
                extra = chunk.model_extra or {}
                if isinstance(extra.get(STAGE_FIELD), dict):
                    stage_s = {str(k): float(v) for k, v in extra[STAGE_FIELD].items()}
                if isinstance(extra.get(PATH_FIELD), list):
                    path = tuple(str(p) for p in extra[PATH_FIELD])
            if not token_times:
                error = "EmptyResponse: stream ended without content"
        except asyncio.CancelledError:
            error = "Cancelled: bench time limit reached"
        except Exception as exc:  # any failure is a data point, not a crash
            error = _error_text(exc)
        end = time.perf_counter()
    return RequestResult(
        request_id=record.request_id or "",
        arrival_s=sent - t0,
        prompt_tokens=record.prompt_tokens,
        num_images=record.num_images,
        output_tokens=record.output_tokens,
        ttft_s=token_times[0] - sent if token_times else None,
        itl_s=tuple(b - a for a, b in itertools.pairwise(token_times)),
        e2e_s=end - sent,
        num_output_tokens=usage_tokens if usage_tokens is not None else len(token_times),
        server_prompt_tokens=server_prompt_tokens,
        expected_prompt_tokens=expected_prompt_tokens,
        server_cached_tokens=cached_tokens,
        error=error,
        send_delay_s=max(0.0, sent - scheduled),
        stage_s=stage_s,
        path=path,
    )


def make_client(config: DriverConfig) -> Any:
    import openai

    # No retries: a retried request would report the sum of both attempts as its latency.
    # The client's pool (1,000 connections) exceeds any sane concurrency; our semaphore bounds it.
    return openai.AsyncOpenAI(
        base_url=config.endpoint,
        api_key=config.api_key,
        max_retries=0,
        timeout=config.request_timeout_s,
    )


async def warm_up(client: Any) -> None:
    """Pay the client's one-off costs (lazy imports, chunk parsers, first connection) before
    the clock starts; otherwise the first requests' TTFT carries ~0.3 s of client overhead.
    Best effort: servers without ``/models`` still get benchmarked."""
    from openai.types.chat import ChatCompletionChunk

    _ = client.chat.completions
    ChatCompletionChunk.model_validate(
        {"id": "w", "object": "chat.completion.chunk", "created": 0, "model": "w",
         "choices": [{"index": 0, "delta": {"content": "w"}, "finish_reason": None}]}
    )  # fmt: skip
    with contextlib.suppress(Exception):  # warm-up only; the run reports real errors
        await client.models.list()


Messages = list[Payload]


def prepare_messages(
    records: Sequence[TraceRecord],
    image_format: str = "jpeg",
    progress: bool = False,
    prompts: TokenExactPrompts | None = None,
    block_tokens: int = 512,
) -> Messages:
    """Payloads per record (input order): prompt text and encoded images (~25 ms per
    1296×968 image), built once so a rate sweep does not re-encode them."""
    from tqdm import tqdm

    items = tqdm(records, desc="payloads", unit="req", disable=not progress, leave=False)
    return [chat_payload(r, i, image_format, prompts, block_tokens) for i, r in enumerate(items)]


def payloads_for(records: Sequence[TraceRecord], config: DriverConfig) -> Messages:
    return prepare_messages(
        records, config.image_format, config.progress, config.prompts, config.block_tokens
    )


def with_ids(records: Sequence[TraceRecord]) -> list[TraceRecord]:
    """Every result needs an id to be matched back to its record (recorded traces may lack
    one)."""
    return [
        r if r.request_id else r.model_copy(update={"request_id": f"req-{i:06d}"})
        for i, r in enumerate(records)
    ]


async def send_warm_up(
    client: Any, config: DriverConfig, records: Sequence[TraceRecord], messages: Messages
) -> None:
    """``config.warmup_requests`` requests (the trace's first ones, cycled) before the clock
    starts: they fill caches and pools; their results are dropped."""
    if not config.warmup_requests or not records:
        return
    limit = asyncio.Semaphore(config.max_concurrency)
    now = time.perf_counter()
    picks = [i % len(records) for i in range(config.warmup_requests)]
    await asyncio.gather(
        *(send_one(client, config, records[i], messages[i], now, limit, now) for i in picks)
    )


async def run_trace(
    records: Sequence[TraceRecord], config: DriverConfig, messages: Messages | None = None
) -> list[RequestResult]:
    """Replay ``records`` by arrival time; one result per record, in the input order.

    Payloads are built before the clock starts (or passed in, from ``prepare_messages``) so
    image encoding never delays a send.
    """
    from tqdm import tqdm

    if messages is None:
        messages = payloads_for(records, config)
    if len(messages) != len(records):
        raise ValueError(f"{len(messages)} messages for {len(records)} records")
    records = with_ids(records)
    start = min((r.arrival_s for r in records), default=0.0)
    if config.duration_s is not None:  # arrivals after the duration are not part of the run
        kept = [i for i, r in enumerate(records) if r.arrival_s - start <= config.duration_s]
        records, messages = [records[i] for i in kept], [messages[i] for i in kept]
    order = sorted(range(len(records)), key=lambda i: records[i].arrival_s)
    client = make_client(config)
    limit = asyncio.Semaphore(config.max_concurrency)
    await warm_up(client)
    await send_warm_up(client, config, records, messages)
    timeout = config.max_duration_s
    if config.duration_s is not None:
        grace_end = config.duration_s + config.grace_s
        timeout = grace_end if timeout is None else min(timeout, grace_end)
    desc = f"bench {config.label}".strip()
    with tqdm(total=len(records), desc=desc, unit="req", disable=not config.progress) as bar:
        t0 = time.perf_counter()
        turns = plan_turns(records)
        tasks = {
            i: asyncio.create_task(
                send_one(client, config, records[i], messages[i],
                         t0 + records[i].arrival_s - start, limit, t0, turns.get(i))
            )
            for i in order
        }  # fmt: skip
        for task in tasks.values():
            task.add_done_callback(lambda _t: bar.update(1))
        try:
            await asyncio.wait(tasks.values(), timeout=timeout)
        finally:
            for task in tasks.values():
                task.cancel()  # unfinished: recorded as cut off by the time limit
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            await client.close()
    out: list[RequestResult] = []
    for i, record in enumerate(records):
        task = tasks[i]
        if not task.cancelled() and task.exception() is None:
            out.append(task.result())
        else:  # cancelled before it was even sent
            out.append(
                RequestResult(
                    request_id=record.request_id or "",
                    arrival_s=record.arrival_s - start,
                    prompt_tokens=record.prompt_tokens,
                    num_images=record.num_images,
                    output_tokens=record.output_tokens,
                    error="NotSent: bench time limit reached",
                )
            )
    return out


def replay(
    records: Sequence[TraceRecord], config: DriverConfig, messages: Messages | None = None
) -> list[RequestResult]:
    """Blocking ``run_trace`` (own event loop); for CLIs and ``find_goodput``."""
    return asyncio.run(run_trace(records, config, messages))


def rate_runner(
    records: Sequence[TraceRecord], config: DriverConfig
) -> Callable[[float], list[RequestResult]]:
    """``run(rate_rps)`` for ``goodput.find_goodput``/``sweep``: the trace replayed at that rate.
    Results come back in arrival order (``at_rate`` sorts)."""
    ordered = sort_by_arrival(records)
    messages = payloads_for(ordered, config)

    def run(rate_rps: float) -> list[RequestResult]:
        return replay(at_rate(ordered, rate_rps), config, messages)

    return run
