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
from epd_engine.scheduler.budget_search import BudgetSearchError, search_budget

MAX_IMAGE_BUDGET = 64  # cap on the image-budget search, in image-cache pages


def derive_budgets(
    cost: FittedCostModel, role: Role, slo: SLO, alpha: float = 0.5
) -> Budgets | None:
    """Budgets of one instance of ``role``; None when even a batch of one misses the limit
    (the engine would refuse to start: that plan cannot meet the SLO on this hardware)."""
    cap = cost.capacity
    limit_s = alpha * (slo.tpot_s if role.decodes else slo.ttft_s)
    token_budget = 1
    image_budget = 1
    try:
        if role.needs_language:
            max_tokens = min(cap.max_model_len - 1, cap.num_kv_blocks * cap.kv_block_size)
            token_budget = search_budget(cost.prefill_s, limit_s, max_tokens)
        if role.runs(Stage.ENCODE):
            # in cache pages, as the engine reads ``--image-budget`` (n x page image tokens an
            # iteration; LLaVA-1.5: n images): exact in tokens whatever the trace's image sizes
            page = cap.image_block_tokens
            image_budget = search_budget(
                lambda n: cost.encode_s(n * page),
                alpha * slo.ttft_s,
                min(cap.num_image_blocks, MAX_IMAGE_BUDGET),
            )
    except BudgetSearchError:
        return None
    return Budgets(image_budget=image_budget, token_budget=token_budget)
