"""A cost model at another tensor-parallel size, projected from the one measured on one rank
and the link the ranks' collectives run over (issue 34).

One step of an instance split over N ranks (``docs/ARCHITECTURE.md``, "Tensor parallelism"):
every rank computes 1/N of the language model's heads, MLP and vocabulary, then the ranks
exchange the hidden states -- an all-reduce after each layer's attention and MLP and after
the embedding, an all-gather of the logits -- plus rank 0's call to the others. So::

    lm_s(N) = fixed_s + collectives x latency_s                       (per step)
            + tokens x (per_token_s / N + reduced_bytes_per_token / bytes_per_s)
            + (per_kpair_s x kpairs + per_kcontext_s x kcontext) / N
            + sampled x (per_sample_s + gathered_logit_bytes / bytes_per_s)

A ring all-reduce of B bytes over N ranks moves 2 (N - 1) / N x B through each link. The
encoder is not split (it runs on rank 0), so its terms stay. What a rank leaves for KV: its
1/N of the weights is gone, so each of its pages holds 1/N of the KV heads
(``kv_blocks``).

This is a projection, not a measurement: ``epdctl profile-costs --tensor-parallel-size N``
measures the real thing, and ``compare`` says how far apart they are.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from epd_engine.parallel.sizing import staging_pages
from epd_engine.profiler.cost_model import FittedCostModel, LanguageCoeffs
from epd_engine.profiler.links import LinkCoeffs
from epd_engine.profiler.rank_costs import RankedShape


def projected(
    one_rank: FittedCostModel, size: int, shape: RankedShape, link: LinkCoeffs
) -> FittedCostModel:
    """``one_rank`` (measured at size 1) as ``size`` ranks over ``link`` would run it."""
    if size == 1:
        return one_rank
    measured = one_rank.meta.get("tensor_parallel_size", 1)
    if measured != 1:
        raise ValueError(f"project from a one-rank cost model, not one of {measured} ranks")
    lm = one_rank.language
    ring = 2 * (size - 1) / size  # share of a ring all-reduce's bytes each link carries
    reduced_bytes_per_token = (2 * shape.num_layers + 1) * shape.hidden_size * shape.dtype_bytes
    language = LanguageCoeffs(
        fixed_s=lm.fixed_s + shape.messages * link.latency_s,
        per_token_s=lm.per_token_s / size + ring * reduced_bytes_per_token / link.bytes_per_s,
        knee_tokens=lm.knee_tokens,
        per_kpair_s=lm.per_kpair_s / size,
        per_kcontext_s=lm.per_kcontext_s / size,
        # each rank receives the others' float32 logits of every sampled row
        per_sample_s=lm.per_sample_s + (size - 1) / size * shape.vocab_size * 4 / link.bytes_per_s,
    )
    meta = {**one_rank.meta, "tensor_parallel_size": size, "projected_from_one_rank": True}
    return replace(one_rank, language=language, meta=meta)


def sized(cost: FittedCostModel, size: int) -> FittedCostModel:
    """``cost`` (measured on one rank) for an instance of ``size`` ranks, as the plan search
    charges it: the language model ``projected`` over the recorded link, and the KV pages
    its ranks hold. A rank's page holds 1/size of the heads, and the weights it no longer
    holds (``(size - 1)/size`` of them) become pages too; rank 0's whole-head staging pages
    for migrations come off (``parallel/kv_staging.py``)."""
    if size == 1:
        return cost
    ranks = cost.ranks
    if ranks is None:
        raise ValueError(
            "this cost model records no tensor-parallel terms (its 'ranks': profile it with "
            "this version's epdctl profile-costs, or plan with --cost-model reference)"
        )
    if size not in ranks.sizes:
        fitting = ", ".join(map(str, ranks.sizes))
        raise ValueError(f"tensor-parallel size {size} does not cut this model; sizes: {fitting}")
    cap = cost.capacity
    per_token = cost.migration.kv_bytes_per_token + cost.migration.kv_windowed_bytes_per_token
    page_bytes = max(1, per_token * cap.kv_block_size)  # every layer's, whole heads
    # one rank's memory for weights and KV, as the one-rank profile left it (reserve apart)
    memory = cap.num_kv_blocks * page_bytes + ranks.weight_bytes
    pages = kv_blocks(memory, ranks.weight_bytes, page_bytes, 0, size)
    pages -= size * staging_pages(cap.max_model_len, cap.kv_block_size)
    capacity = replace(cap, num_kv_blocks=max(0, pages))
    return replace(projected(cost, size, ranks.shape, ranks.link), capacity=capacity)


def kv_blocks(
    free_bytes: int, weight_bytes: int, page_bytes: int, reserve_bytes: int, size: int
) -> int:
    """KV pages one rank of ``size`` holds: its GPU's ``free_bytes`` less its 1/size of the
    weights and its activation reserve, in pages of 1/size of the KV heads (``page_bytes``:
    a whole page's). Every rank holds the same page ids, so this is the instance's count."""
    left = free_bytes - weight_bytes // size - reserve_bytes
    return max(0, left // max(1, page_bytes // size))


def compare(projection: FittedCostModel, measured: FittedCostModel, shapes: list[Any]) -> dict:
    """Projected vs measured step times over ``shapes`` (``BatchShape``s): the ratio's range
    and median, to say how far the projection can be trusted on this machine."""
    ratios = sorted(projection.step_s(s) / measured.step_s(s) for s in shapes)
    return {
        "min": ratios[0],
        "median": ratios[len(ratios) // 2],
        "max": ratios[-1],
        "num_shapes": len(ratios),
    }
