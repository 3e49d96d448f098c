"""Factories for profiler tests: crafted traces and a small, explicit cost model."""

from __future__ import annotations

from epd_engine.contracts.trace import ImageRef, TraceRecord
from epd_engine.profiler.cost_model import (
    Capacity,
    EncodeCoeffs,
    FittedCostModel,
    LanguageCoeffs,
    MigrationCoeffs,
)
from epd_engine.profiler.simulator import SimResult


def assert_same_simulation(got: SimResult, want: SimResult) -> None:
    """Two simulations identical to the last float: steps, end, early stop, busy time and
    every request's result."""
    assert got.num_steps == want.num_steps
    assert got.end_s == want.end_s
    assert got.stopped_early == want.stopped_early
    assert got.busy_s_by_role == want.busy_s_by_role
    for mine, theirs in zip(got.results, want.results, strict=True):
        assert mine == theirs, f"request {theirs.request_id} diverged"


def toy_cost_model(
    encode_per_image_s: float = 0.01,
    prefill_per_token_s: float = 1e-4,
    decode_step_s: float = 0.005,
    tokens_per_image: int | None = None,
) -> FittedCostModel:
    """Costs chosen so a test can reason about them: 100 image tokens per image by default."""
    return FittedCostModel(
        encode=EncodeCoeffs(fixed_s=0.0, per_token_s=encode_per_image_s / 100, knee_tokens=0),
        language=LanguageCoeffs(
            fixed_s=decode_step_s,
            per_token_s=prefill_per_token_s,
            knee_tokens=0,
            per_kpair_s=0.0,
            per_kcontext_s=0.0,
            per_sample_s=0.0,
        ),
        migration=MigrationCoeffs(
            latency_s=0.001, bytes_per_s=1e9, image_bytes_per_token=1024, kv_bytes_per_token=4096
        ),
        capacity=Capacity(
            num_kv_blocks=2048,
            kv_block_size=16,
            num_image_blocks=64,
            image_block_tokens=100,
            max_num_running=64,
            max_model_len=4096,
            tokens_per_image=tokens_per_image,
        ),
        meta={"source": "tests"},
    )


def make_trace(
    num: int = 40,
    rate_rps: float = 10.0,
    prompt_tokens: int = 20,
    images_per_request: int = 1,
    image_tokens: int = 100,
    output_tokens: int = 5,
    text_only_every: int = 0,
    shared_images: bool = False,
) -> list[TraceRecord]:
    """Evenly spaced requests; every ``text_only_every``-th one has no image."""
    records = []
    for i in range(num):
        text_only = text_only_every > 0 and i % text_only_every == 0
        images = (
            ()
            if text_only
            else tuple(
                ImageRef(
                    tokens=image_tokens,
                    hash="same" if shared_images else f"img-{i}-{k}",
                    width=336,
                    height=336,
                )
                for k in range(images_per_request)
            )
        )
        records.append(
            TraceRecord(
                request_id=f"r{i}",
                arrival_s=i / rate_rps,
                prompt_tokens=prompt_tokens,
                images=images,
                output_tokens=output_tokens,
            )
        )
    return records
