"""The image cache's all-or-nothing admission, on the real pool."""

from __future__ import annotations

from epd_engine.cache.image_cache import ImageCacheManager


def test_admission_never_evicts_a_cached_image_it_counted_as_a_hit() -> None:
    """Defect: admission counted a cached, unreferenced image as present, then allocating
    the request's other image evicted it, and the hit it had counted failed (an assertion
    on the engine thread). Hits are now pinned before anything is allocated."""
    cache = ImageCacheManager(num_blocks=2, block_tokens=4)
    [cached] = cache.acquire_all("earlier", [("a", 4)]) or []
    cache.mark_encoded("a", cached)
    cache.release("earlier")  # "a" stays cached, evictable
    assert cache.acquire_all("holder", [("x", 4)]) is not None  # the other page is busy

    assert cache.acquire_all("r", [("b", 4), ("a", 4)]) is None  # "b" has no room: waits
    assert cache.pool.contains("a") and not cache.slots("r")

    cache.release("holder")
    slots = cache.acquire_all("r", [("b", 4), ("a", 4)])
    assert slots is not None and [s.cached for s in slots] == [False, True]
    assert slots[1].blocks == cached.blocks
