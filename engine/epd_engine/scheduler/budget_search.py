"""The batch-budget rule (HydraInfer): the largest batch whose iteration stays under a limit.

One rule for the engine, which measures real batches at start-up, and the profiler, which asks
its cost model: an iteration of an instance that decodes stays under alpha x TPOT, of one that
does not under alpha x TTFT; an encode batch under alpha x TTFT. Pure: the caller passes a
``measure`` function returning a batch's iteration time in seconds, and only a size that was
measured as passing is returned.
"""

from __future__ import annotations

from collections.abc import Callable

from epd_engine.config import SLO, Role

MAX_IMAGE_SEARCH = 64  # the image-budget search stops here (images, or image-cache pages)


def token_limit_s(role: Role, slo: SLO, alpha: float) -> float:
    """The iteration time a token batch of ``role`` must stay under."""
    return alpha * (slo.tpot_s if role.decodes else slo.ttft_s)


def image_limit_s(slo: SLO, alpha: float) -> float:
    """The time an encode batch must stay under (it delays first tokens, never decode gaps)."""
    return alpha * slo.ttft_s


def max_prefill_tokens(max_model_len: int, num_kv_blocks: int, kv_block_size: int) -> int:
    """The largest token batch worth probing: one prompt that fills the context or the cache."""
    return min(max_model_len - 1, num_kv_blocks * kv_block_size)


class BudgetSearchError(RuntimeError):
    """Even the smallest batch misses the limit: the SLO cannot be met on this hardware."""


def search_budget(measure: Callable[[int], float], limit_s: float, max_size: int) -> int:
    """Largest ``n`` in ``[1, max_size]`` with ``measure(n) <= limit_s`` (time grows with n)."""
    if max_size < 1:
        raise ValueError(f"max_size must be >= 1, got {max_size}")
    first_s = measure(1)
    if first_s > limit_s:
        raise BudgetSearchError(
            f"a batch of 1 takes {first_s * 1e3:.1f} ms, over the {limit_s * 1e3:.1f} ms limit"
        )
    passing, failing = 1, max_size + 1  # invariant: passing measured ok, failing not ok
    while failing - passing > 1:
        mid = (passing + failing) // 2
        if measure(mid) <= limit_s:
            passing = mid
        else:
            failing = mid
    return passing
