"""How an instance's scheduler is set up from a cost model's capacity and a role's budgets,
as ``LLMEngine`` sets up its own: shared by the simulator and the emulated instance (a
module of its own, so the emulator's start imports none of the simulator)."""

from __future__ import annotations

from epd_engine.cache.image_cache import ImageCacheManager
from epd_engine.cache.kv_cache import KVCacheManager
from epd_engine.config import Role, Stage
from epd_engine.contracts.plan import Budgets
from epd_engine.profiler.cost_model import Capacity
from epd_engine.scheduler import SchedulerLimits


def scheduler_parts(
    role: Role, budgets: Budgets, capacity: Capacity, prefix_salt: str | None
) -> tuple[SchedulerLimits, KVCacheManager | None, ImageCacheManager | None]:
    """A scheduler's limits and cache managers, set up the way ``LLMEngine`` sets up its own
    (``prefix_salt``: KV pages cached by key; None: no prefix cache). The simulator and the
    emulated instance both build theirs from it."""
    kv = (
        KVCacheManager(capacity.num_kv_blocks, capacity.kv_block_size, prefix_salt)
        if role.needs_language
        else None
    )
    with_images = role.runs(Stage.ENCODE) or role.runs(Stage.PREFILL)
    images = (
        ImageCacheManager(capacity.num_image_blocks, capacity.image_block_tokens)
        if with_images
        else None
    )
    limits = SchedulerLimits(
        token_budget=budgets.token_budget,
        image_token_budget=budgets.image_budget * capacity.image_block_tokens,  # as the engine
        max_num_running=capacity.max_num_running,
        max_model_len=capacity.max_model_len,
    )
    return limits, kv, images
