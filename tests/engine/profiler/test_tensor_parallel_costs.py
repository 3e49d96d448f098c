"""The cost of a tensor-parallel instance, projected from one rank's (issue 34): compute
split N ways, a collective's latency per message and its bytes per token over the link, and
the KV pages a rank's share of memory holds."""

from __future__ import annotations

import pytest

from epd_engine.profiler.cost_model import BatchShape, FittedCostModel, LanguageCoeffs
from epd_engine.profiler.links import LinkCoeffs
from epd_engine.profiler.rank_costs import RankedShape
from epd_engine.profiler.tensor_parallel import compare, kv_blocks, projected

ONE_RANK = FittedCostModel(
    language=LanguageCoeffs(fixed_s=0.004, per_token_s=2e-5, knee_tokens=64,
                            per_kpair_s=1e-5, per_kcontext_s=3e-4, per_sample_s=1e-5),
)  # fmt: skip
SHAPE = RankedShape(num_layers=32, hidden_size=4096, vocab_size=32000, dtype_bytes=2)
NVLINK = LinkCoeffs(latency_s=10e-6, bytes_per_s=150e9)
SLOW = LinkCoeffs(latency_s=1e-3, bytes_per_s=1e9)
PREFILL = BatchShape(num_tokens=4096, prefill_kpairs=4096 * 2048 / 1000, num_sampled=1)
DECODE = BatchShape(num_tokens=8, decode_kcontext=8 * 1024 / 1000, num_sampled=8)


def test_a_fast_link_nearly_halves_a_long_prefill():
    two = projected(ONE_RANK, 2, SHAPE, NVLINK)
    ratio = two.step_s(PREFILL) / ONE_RANK.step_s(PREFILL)
    # compute halves; 4,096 tokens x 65 all-reduces x 8 KiB each move 2.2 GB: 15 ms of 100
    assert 0.5 < ratio < 0.65
    assert two.meta["tensor_parallel_size"] == 2


def test_a_slow_link_makes_small_steps_slower_not_faster():
    """On gloo over a loaded host (1 ms a message) a decode step pays 68 messages: two ranks
    lose there, which is what the CPU measured (docs/planning.md)."""
    two = projected(ONE_RANK, 2, SHAPE, SLOW)
    assert two.step_s(DECODE) > 10 * ONE_RANK.step_s(DECODE)


def test_more_ranks_cut_compute_but_add_messages():
    steps = [projected(ONE_RANK, n, SHAPE, NVLINK).step_s(PREFILL) for n in (1, 2, 4, 8)]
    assert steps == sorted(steps, reverse=True)
    fixed = [projected(ONE_RANK, n, SHAPE, NVLINK).language.fixed_s for n in (1, 2, 4)]
    assert fixed[0] < fixed[1] == fixed[2]  # the message count per step does not grow with N


def test_the_encoder_is_not_split():
    two = projected(ONE_RANK, 2, SHAPE, NVLINK)
    assert two.encode == ONE_RANK.encode


def test_only_a_one_rank_model_is_projected():
    two = projected(ONE_RANK, 2, SHAPE, NVLINK)
    with pytest.raises(ValueError, match="one-rank cost model"):
        projected(two, 4, SHAPE, NVLINK)


def test_a_rank_holds_pages_of_its_heads_only():
    gib = 1 << 30
    one = kv_blocks(80 * gib, 14 * gib, 2 * 1024 * 1024, 4 * gib, 1)
    two = kv_blocks(80 * gib, 14 * gib, 2 * 1024 * 1024, 4 * gib, 2)
    assert one == (80 - 14 - 4) * 512
    assert two == (80 - 7 - 4) * 1024  # half the weights, half a page: over twice the pages
    assert kv_blocks(8 * gib, 14 * gib, 2 << 20, gib, 1) == 0  # weights do not fit


def test_compare_reports_the_ratio_range():
    two = projected(ONE_RANK, 2, SHAPE, NVLINK)
    report = compare(two, two, [PREFILL, DECODE])
    assert report == {"min": 1.0, "median": 1.0, "max": 1.0, "num_shapes": 2}


@pytest.mark.slow
def test_the_ranks_link_is_measured_across_processes():
    """Two fresh gloo processes all-reduce one row and 4,096 rows: a latency and a bandwidth
    the projection can charge (what bench_tp_projection.py uses)."""
    import torch

    from epd_engine.bench.allreduce_link import measure_allreduce_link

    link = measure_allreduce_link(2, 64, torch.float32, repeats=5)
    assert 0 < link.latency_s < 1.0
    assert link.bytes_per_s > 1e6
