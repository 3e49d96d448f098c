"""Batch budgets of a pool, derived from a cost model exactly as the engine does at start-up.

The engine binary-searches the largest batch whose *measured* iteration time stays under
alpha x TTFT (E/P/EP instances) or alpha x TPOT (instances that decode) (HydraInfer,
alpha = 0.5). Here the same ``search_budget`` runs against the cost model's prediction, so a
plan's budgets follow its SLO without re-measuring.
"""

from __future__ import annotations

from epd_engine.config import SLO, Role, Stage
from epd_engine.contracts.plan import Budgets
from epd_engine.profiler.cost_model import FittedCostModel
from epd_engine.scheduler.budget_search import (
    MAX_IMAGE_SEARCH,
    BudgetSearchError,
    image_limit_s,
    max_prefill_tokens,
    search_budget,
    token_limit_s,
)


def derive_budgets(
    cost: FittedCostModel, role: Role, slo: SLO, alpha: float = 0.5
) -> Budgets | None:
    """Budgets of one instance of ``role``; None when even a batch of one misses the limit
    (the engine would refuse to start: that plan cannot meet the SLO on this hardware)."""
    cap = cost.capacity
    token_budget = 1
    image_budget = 1
    try:
        if role.needs_language:
            max_tokens = max_prefill_tokens(cap.max_model_len, cap.num_kv_blocks, cap.kv_block_size)
            token_budget = search_budget(
                cost.prefill_s, token_limit_s(role, slo, alpha), max_tokens
            )
        if role.runs(Stage.ENCODE):
            # in cache pages, as the engine reads ``--image-budget`` (n x page image tokens an
            # iteration; LLaVA-1.5: n images): exact in tokens whatever the trace's image sizes
            page = cap.image_block_tokens
            image_budget = search_budget(
                lambda n: cost.encode_s(n * page),
                image_limit_s(slo, alpha),
                min(cap.num_image_blocks, MAX_IMAGE_SEARCH),
            )
    except BudgetSearchError:
        return None
    return Budgets(image_budget=image_budget, token_budget=token_budget)
