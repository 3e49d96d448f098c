"""Per-request outcomes and their aggregate statistics (mean/p50/p90/p99).

``RequestResult`` is what the load driver measures and what the simulator predicts; both feed
``summarize`` and ``epd_engine.slo.attainment`` so real and simulated runs report the same numbers.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from epd_engine.config import SLO
from epd_engine.contracts.trace import TraceRecord, nearest_rank
from epd_engine.slo.attainment import attainment


@dataclass(frozen=True, slots=True)
class RequestResult:
    """One request's outcome. Times in seconds; ``arrival_s`` is when it was sent, relative to
    the run start. ``itl_s`` holds every inter-token gap (one per streamed chunk after the first).
    """

    request_id: str
    arrival_s: float
    prompt_tokens: int = 0
    num_images: int = 0
    output_tokens: int = 0  # requested
    ttft_s: float | None = None
    itl_s: tuple[float, ...] = ()
    e2e_s: float | None = None
    num_output_tokens: int = 0  # received (server usage, else streamed chunks)
    server_prompt_tokens: int | None = None  # the server's count: template + text + images
    expected_prompt_tokens: int | None = None  # what the payload was built for (tokenizer)
    # usage.prompt_tokens_details.cached_tokens: prompt tokens the server served from cache
    server_cached_tokens: int | None = None
    error: str | None = None
    send_delay_s: float = 0.0  # client-side lag behind the scheduled arrival
    stage_s: Mapping[str, float] | None = None  # per-stage seconds, when the server reports them
    path: tuple[str, ...] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None

    @property
    def prompt_mismatch(self) -> int | None:
        """Server-counted minus intended prompt tokens (None when either is unknown)."""
        if self.expected_prompt_tokens is None or self.server_prompt_tokens is None:
            return None
        return self.server_prompt_tokens - self.expected_prompt_tokens

    @property
    def tpot_p90_s(self) -> float:
        """Nearest-rank p90 of the gaps: <= SLO exactly when 90% of gaps are (HydraInfer)."""
        return nearest_rank(self.itl_s, 0.9)

    @property
    def tpot_mean_s(self) -> float | None:
        """Mean time per output token after the first (vLLM's TPOT); None with < 2 tokens."""
        return sum(self.itl_s) / len(self.itl_s) if self.itl_s else None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["itl_s"] = [round(gap, 6) for gap in self.itl_s]
        data["stage_s"] = dict(self.stage_s) if self.stage_s else None
        return data

    def to_trace_record(self, source: TraceRecord) -> TraceRecord:
        """``source`` annotated with what was measured (a measured trace for the profiler)."""
        return source.model_copy(
            update={
                "ttft_s": self.ttft_s,
                "tpot_s": self.itl_s if self.ok else None,
                "e2e_s": self.e2e_s,
                "stage_s": dict(self.stage_s) if self.stage_s else source.stage_s,
                "path": self.path or source.path,
            }
        )


@dataclass(frozen=True)
class LatencyStats:
    """Distribution of one latency over requests (seconds)."""

    count: int
    mean_s: float
    p50_s: float
    p90_s: float
    p99_s: float
    max_s: float

    @classmethod
    def of(cls, values: Sequence[float] | np.ndarray) -> LatencyStats:
        if len(values) == 0:
            return cls(0, 0.0, 0.0, 0.0, 0.0, 0.0)
        arr = np.asarray(values, dtype=float)
        p50, p90, p99 = np.percentile(arr, [50, 90, 99])  # linear interpolation, as vLLM's bench
        return cls(
            len(arr), float(arr.mean()), float(p50), float(p90), float(p99), float(arr.max())
        )


@dataclass(frozen=True)
class BenchSummary:
    """Aggregate of one run at one rate."""

    num_requests: int
    num_ok: int
    num_errors: int
    duration_s: float
    request_throughput_rps: float
    output_throughput_tps: float
    ttft: LatencyStats
    tpot: LatencyStats  # per-request mean gap
    tpot_p90: LatencyStats  # per-request p90 gap (the SLO quantity)
    itl: LatencyStats  # every gap of every request
    e2e: LatencyStats
    attainment: float | None = None  # share of all requests meeting the SLO
    slo: dict[str, float] | None = None
    errors: dict[str, int] = field(default_factory=dict)  # first words of the error -> count
    max_send_delay_s: float = 0.0
    num_short_outputs: int = 0  # ok requests that got fewer tokens than asked (EOS not ignored?)
    num_output_mismatches: int = 0  # ok requests whose usage differs from the asked length
    num_prompt_mismatches: int = 0  # ok requests whose usage.prompt_tokens differs from intent
    mean_prompt_mismatch: float = 0.0  # mean (server - intended) over the mismatching ones
    # ok requests' prompt tokens the server reported served from cache (None: never reported)
    cached_prompt_tokens: int | None = None
    stage_mean_s: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_duration_s(results: Sequence[RequestResult]) -> float:
    """From the first send to the last completion (or send, for requests that never finished)."""
    if not results:
        return 0.0
    start = min(r.arrival_s for r in results)
    end = max(r.arrival_s + (r.e2e_s or 0.0) for r in results)
    return end - start


def _error_kind(error: str) -> str:
    return error.split(":", 1)[0][:60]


def summarize(
    results: Sequence[RequestResult], slo: SLO | None = None, duration_s: float | None = None
) -> BenchSummary:
    """Aggregate a run; with ``slo`` also the attainment (errors count as misses)."""
    ok = [r for r in results if r.ok]
    duration = run_duration_s(results) if duration_s is None else duration_s
    errors: dict[str, int] = {}
    for r in results:
        if r.error is not None:
            errors[_error_kind(r.error)] = errors.get(_error_kind(r.error), 0) + 1
    prompt_deltas = [d for r in ok if (d := r.prompt_mismatch)]
    cached = [r.server_cached_tokens for r in ok if r.server_cached_tokens is not None]
    stage_totals: dict[str, list[float]] = {}
    for r in ok:
        for stage, seconds in (r.stage_s or {}).items():
            stage_totals.setdefault(stage, []).append(seconds)
    # each request's p90 gap sorts its gaps: once, for its statistics and the attainment
    p90_of = {id(r): r.tpot_p90_s for r in ok}
    gaps = np.fromiter(
        itertools.chain.from_iterable(r.itl_s for r in ok),
        dtype=float,
        count=sum(len(r.itl_s) for r in ok),
    )
    return BenchSummary(
        num_requests=len(results),
        num_ok=len(ok),
        num_errors=len(results) - len(ok),
        duration_s=duration,
        request_throughput_rps=len(ok) / duration if duration > 0 else 0.0,
        output_throughput_tps=sum(r.num_output_tokens for r in ok) / duration
        if duration > 0
        else 0.0,
        ttft=LatencyStats.of([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot=LatencyStats.of([t for r in ok if (t := r.tpot_mean_s) is not None]),
        tpot_p90=LatencyStats.of([p90_of[id(r)] for r in ok if r.itl_s]),
        itl=LatencyStats.of(gaps),
        e2e=LatencyStats.of([r.e2e_s for r in ok if r.e2e_s is not None]),
        attainment=attainment(results, slo, lambda r: p90_of[id(r)]) if slo is not None else None,
        slo={"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "attainment": slo.attainment}
        if slo
        else None,
        errors=errors,
        max_send_delay_s=max((r.send_delay_s for r in results), default=0.0),
        num_short_outputs=sum(r.num_output_tokens < r.output_tokens for r in ok),
        num_output_mismatches=sum(r.num_output_tokens != r.output_tokens for r in ok),
        num_prompt_mismatches=len(prompt_deltas),
        mean_prompt_mismatch=float(np.mean(prompt_deltas)) if prompt_deltas else 0.0,
        stage_mean_s={k: float(np.mean(v)) for k, v in sorted(stage_totals.items())},
        cached_prompt_tokens=sum(cached) if cached else None,
    )
