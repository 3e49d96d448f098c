"""Paged image-embedding cache that doubles as the encoder-output cache.

Each image's embeddings occupy ``ceil(num_tokens / block_tokens)`` pages. Pages are keyed by
the image's content hash, so a later request with the same image reuses them and skips
encode; unreferenced images stay until the pages are needed (LRU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epd_engine.cache.block_pool import BlockPool
from epd_engine.cache.kv_cache import blocks_needed


@dataclass
class ImageSlot:
    blocks: list[int]
    cached: bool  # True: embeddings already there (a hit); False: must be encoded
    hit: bool = False  # found in the cache when acquired (cached_tokens)


class ImageCacheManager:
    def __init__(self, num_blocks: int, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.pool = BlockPool(num_blocks)
        self._slots: dict[str, list[ImageSlot]] = {}  # request_id -> slot per image, in order
        self.num_hits = 0
        self.num_lookups = 0

    def slots(self, request_id: str) -> list[ImageSlot]:
        return self._slots.get(request_id, [])

    def acquire_all(
        self, request_id: str, images: Sequence[tuple[str, int]]
    ) -> list[ImageSlot] | None:
        """Pages for every ``(content_hash, num_tokens)`` image of a request, all or nothing.

        Hits are pinned before any page is allocated: a cached image counted as present could
        otherwise be evicted to make room for the request's other images.
        """
        slots: list[ImageSlot | None] = []
        for content_hash, _ in images:
            hit = self.pool.lookup(content_hash)
            slots.append(None if hit is None else ImageSlot(hit, cached=True, hit=True))
        sizes = [blocks_needed(num_tokens, self.block_tokens) for _, num_tokens in images]
        missing = sum(size for size, slot in zip(sizes, slots, strict=True) if slot is None)
        if not self.pool.can_allocate(missing):
            for slot in slots:
                if slot is not None:
                    self.pool.free(slot.blocks)
            return None
        acquired = []
        for size, slot in zip(sizes, slots, strict=True):
            if slot is None:
                blocks = self.pool.allocate(size)
                assert blocks is not None  # counted above
                slot = ImageSlot(blocks, cached=False)
            acquired.append(slot)
        self.num_lookups += len(acquired)
        self.num_hits += sum(slot.cached for slot in acquired)
        self._slots.setdefault(request_id, []).extend(acquired)
        return acquired

    def mark_encoded(self, content_hash: str, slot: ImageSlot) -> None:
        """Encode wrote the pages: publish them under the hash for later requests."""
        slot.cached = True
        self.pool.register(content_hash, slot.blocks)

    def release(self, request_id: str) -> None:
        for slot in self._slots.pop(request_id, []):
            self.pool.free(slot.blocks)
