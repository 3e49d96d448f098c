"""The scheduler's side of the prefix cache: find a request's cached pages, publish its own.

A request that is about to compute its sequence from the start (its first prefill here, a
recompute after preemption) or to pull it (a migration target) first takes the longest run
of cached pages that its page keys lead (``cache/kv_cache.py``): those tokens count as
computed. A prefill keeps at least one token to compute (the first output token needs its
logits); a pull may find every full page, and moves only the rest. Pages are registered
once written: after the step that computed them, never while a pull is filling them.
"""

from __future__ import annotations

from epd_engine.cache.image_cache import ImageCacheManager
from epd_engine.cache.kv_cache import KVCacheManager
from epd_engine.request import Request


def match_prefix(kv: KVCacheManager, request: Request, max_tokens: int) -> int:
    """Take the cached pages that lead ``request``'s first ``max_tokens`` tokens into its
    (empty) table; returns the tokens they hold (0 without a prefix cache)."""
    hasher = kv.hasher
    if hasher is None:
        return 0
    num_pages = max_tokens // kv.block_size
    keys = request.page_keys
    hasher.extend(keys, request.token_ids_slice, request.images, num_pages * kv.block_size)
    num_hit = kv.match_prefix(request.request_id, keys[:num_pages])
    request.num_registered_pages = num_hit
    request.num_prefix_hit_tokens = num_hit * kv.block_size
    return request.num_prefix_hit_tokens


def match_for_prefill(
    kv: KVCacheManager, images: ImageCacheManager | None, request: Request
) -> None:
    """Before a request's prefill from token 0: skip what the cache holds, and count what it
    served (text and images, at its first admission) as ``num_cached_tokens``."""
    num_tokens = request.num_tokens
    hit_tokens = match_prefix(kv, request, num_tokens - 1)
    kv.count_lookup(num_tokens, hit_tokens)
    request.num_computed_tokens = hit_tokens
    if request.num_preemptions == 0:
        request.num_cached_tokens = max(
            request.num_cached_tokens, cached_tokens(images, request, hit_tokens)
        )


def cached_tokens(images: ImageCacheManager | None, request: Request, hit_tokens: int) -> int:
    """Prompt tokens a cache served: the first ``hit_tokens`` (KV), and the placeholder
    tokens after them of every image found in the image cache (encode skipped)."""
    total = hit_tokens
    slots = images.slots(request.request_id) if images is not None else []
    for image, slot in zip(request.images, slots, strict=False):
        if slot.hit:
            end = image.offset + image.num_tokens
            total += max(0, end - max(image.offset, hit_tokens))
    return total


def register_written(kv: KVCacheManager, request: Request) -> None:
    """Publish the request's pages whose K/V are all written (its full computed pages)."""
    hasher = kv.hasher
    if hasher is None or request.pulling:
        return
    num_full = request.num_computed_tokens // kv.block_size
    first = request.num_registered_pages
    if num_full <= first:
        return
    keys = request.page_keys
    hasher.extend(keys, request.token_ids_slice, request.images, num_full * kv.block_size)
    kv.register(request.request_id, keys[:num_full], first)
    request.num_registered_pages = min(num_full, len(keys))
