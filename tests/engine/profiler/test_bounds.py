"""The bound's encode work charges each image at its trace tokens, in the fullest batch the
engine's image budget (in tokens) lets it share: a large image is encoded alone."""

from __future__ import annotations

import dataclasses

import pytest

from epd_engine.config import Stage
from epd_engine.contracts.plan import Budgets
from epd_engine.profiler.bounds import stage_work
from epd_engine.profiler.cost_model import EncodeCoeffs

from .factories import make_trace, toy_cost_model

FIXED_S, PER_TOKEN_S = 0.02, 1e-4  # a fixed cost per encode batch makes batching matter


def _encode_work(image_tokens: int, image_budget: int) -> float:
    cost = dataclasses.replace(
        toy_cost_model(), encode=EncodeCoeffs(fixed_s=FIXED_S, per_token_s=PER_TOKEN_S)
    )
    assert cost.capacity.tokens_per_image is None  # by resolution: the trace's tokens
    budgets = {stage: Budgets(image_budget=image_budget, token_budget=64) for stage in Stage}
    trace = make_trace(20, image_tokens=image_tokens)
    return stage_work(trace, cost, budgets).encode_s


def test_small_images_share_the_budgets_batch() -> None:
    # 2 pages of 100 tokens: four 50-token images a batch, the fixed cost shared four ways
    assert _encode_work(50, image_budget=2) == pytest.approx(FIXED_S / 4 + 50 * PER_TOKEN_S)


def test_an_image_larger_than_the_budget_is_charged_alone() -> None:
    # 1000 tokens in a 200-token budget: one batch of its own (not five 200-token batches)
    assert _encode_work(1000, image_budget=2) == pytest.approx(FIXED_S + 1000 * PER_TOKEN_S)


def test_the_bound_and_the_order_keys_agree_with_their_dict_and_dataclass_forms() -> None:
    """The search bounds and sorts every candidate of a fleet with tuples of builtins
    (``counts_bound``, ``order_key``); they must give what the dict and the dataclass give."""
    import random

    from epd_engine.profiler.bounds import capacity_bound, counts_bound
    from epd_engine.profiler.candidates import enumerate_candidates, order_key

    candidates = enumerate_candidates(12, tp_sizes=(1, 2))
    rng = random.Random(0)
    for c in candidates:
        work = {r: rng.choice([0.0, rng.random()]) for r in c.method.roles}
        in_order = tuple(work[r] for r in c.method.roles)
        assert counts_bound(c.counts, in_order) == capacity_bound(c.pools, work)
    shuffled = rng.sample(candidates, len(candidates))
    assert sorted(shuffled, key=order_key) == sorted(shuffled)
