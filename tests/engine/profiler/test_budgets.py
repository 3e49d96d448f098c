from __future__ import annotations

from epd_engine.config import SLO, Role
from epd_engine.profiler.budgets import derive_budgets

from .factories import toy_cost_model


def test_budgets_follow_the_slo_like_the_engine() -> None:
    cost = toy_cost_model(prefill_per_token_s=1e-4, decode_step_s=0.005)
    slo = SLO(ttft_s=1.0, tpot_s=0.05)
    prefill = derive_budgets(cost, Role.P, slo)
    decode = derive_budgets(cost, Role.D, slo)
    assert prefill is not None and decode is not None
    # P: 0.005 + 1e-4 n <= 0.5 s -> n <= 4950, capped by the context window (4095)
    assert prefill.token_budget == 4095
    # D: 0.005 + 1e-4 n <= 0.025 s -> n <= 200
    assert decode.token_budget == 200
    encode = derive_budgets(cost, Role.E, slo)
    assert encode is not None and encode.image_budget == 50  # 0.01 s/image, 0.5 s, page cap 64
    assert encode.token_budget == 1


def test_a_slo_no_batch_meets_gives_none() -> None:
    cost = toy_cost_model(decode_step_s=0.05)
    assert derive_budgets(cost, Role.PD, SLO(ttft_s=1.0, tpot_s=0.05)) is None
    assert derive_budgets(cost, Role.P, SLO(ttft_s=1.0, tpot_s=0.05)) is not None
