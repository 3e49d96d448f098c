"""Paged image-embedding cache that doubles as the encoder-output cache.

Each image's embeddings occupy ``ceil(num_tokens / block_tokens)`` pages. Pages are keyed by
the image's content hash, so a later request with the same image reuses them and skips
encode; unreferenced images stay until the pages are needed (LRU).
"""

from __future__ import annotations

from dataclasses import dataclass

from epd_engine.cache.block_pool import BlockPool
from epd_engine.cache.kv_cache import blocks_needed


@dataclass
class ImageSlot:
    blocks: list[int]
    cached: bool  # True: embeddings already there (a hit); False: must be encoded


class ImageCacheManager:
    def __init__(self, num_blocks: int, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.pool = BlockPool(num_blocks)
        self._slots: dict[str, list[ImageSlot]] = {}  # request_id -> slot per image, in order
        self.num_hits = 0
        self.num_lookups = 0

    def slots(self, request_id: str) -> list[ImageSlot]:
        return self._slots.get(request_id, [])

    def acquire(self, request_id: str, content_hash: str, num_tokens: int) -> ImageSlot | None:
        """Pages for the request's next image: a cache hit, fresh pages, or None if full."""
        self.num_lookups += 1
        hit = self.pool.lookup(content_hash)
        if hit is not None:
            self.num_hits += 1
            slot = ImageSlot(hit, cached=True)
        else:
            blocks = self.pool.allocate(blocks_needed(num_tokens, self.block_tokens))
            if blocks is None:
                return None
            slot = ImageSlot(blocks, cached=False)
        self._slots.setdefault(request_id, []).append(slot)
        return slot

    def mark_encoded(self, content_hash: str, slot: ImageSlot) -> None:
        """Encode wrote the pages: publish them under the hash for later requests."""
        slot.cached = True
        self.pool.register(content_hash, slot.blocks)

    def release(self, request_id: str) -> None:
        for slot in self._slots.pop(request_id, []):
            self.pool.free(slot.blocks)
