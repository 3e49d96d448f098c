"""Per-request page tables over the KV block pool, with an optional prefix cache.

With a prefix cache (``prefix_salt`` given), a full page is registered in the pool under
its key (``prefix_hash.py``) once its K/V are written; a later request whose first pages
have the same keys takes those pages by reference (``match_prefix``) instead of computing
them. A released page that is registered stays cached until an allocation needs its room
(least recently used first; a table is freed tail first, so a prefix's deepest pages go
before its root).
"""

from __future__ import annotations

from collections.abc import Sequence

from epd_engine.cache.block_pool import BlockPool
from epd_engine.cache.prefix_hash import PageHasher


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_salt: str | None = None) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}
        # None: no prefix cache (every page is private to its request)
        self.hasher = PageHasher(block_size, prefix_salt) if prefix_salt is not None else None
        self.num_queried_tokens = 0  # tokens looked up in the prefix cache
        self.num_hit_tokens = 0  # of those, found
        self.num_pulled_pages = 0  # pages migrations into this instance asked the source for
        self.num_held_pages = 0  # pages they found here instead (prefix cache)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_new_blocks(self, request_id: str, num_total_tokens: int) -> int:
        have = len(self._tables.get(request_id, ()))
        return max(0, blocks_needed(num_total_tokens, self.block_size) - have)

    def can_grow(self, request_id: str, num_total_tokens: int) -> bool:
        return self.pool.can_allocate(self.num_new_blocks(request_id, num_total_tokens))

    def grow(self, request_id: str, num_total_tokens: int) -> bool:
        """Ensure pages for ``num_total_tokens`` tokens; False (no change) if they don't fit."""
        need = self.num_new_blocks(request_id, num_total_tokens)
        if need == 0:
            self._tables.setdefault(request_id, [])
            return True
        blocks = self.pool.allocate(need)
        if blocks is None:
            return False
        self._tables.setdefault(request_id, []).extend(blocks)
        return True

    def add_pages(self, request_ids: list[str]) -> bool:
        """One more page at the end of each request's table; False (no change) if they do
        not all fit."""
        blocks = self.pool.allocate(len(request_ids))
        if blocks is None:
            return False
        tables = self._tables
        for request_id, block in zip(request_ids, blocks, strict=True):
            tables[request_id].append(block)
        return True

    def adopt(self, request_id: str, blocks: list[int]) -> None:
        """Take ownership of pages allocated elsewhere (a migration target's pull)."""
        self._tables.setdefault(request_id, []).extend(blocks)

    def release(self, request_id: str) -> None:
        blocks = self._tables.pop(request_id, None)
        if blocks:
            self.pool.free(blocks[::-1])  # tail first: the deepest cached pages evict first

    # ---- prefix cache -----------------------------------------------------------------
    def match_prefix(self, request_id: str, page_keys: Sequence[str]) -> int:
        """Start an empty table with the longest run of cached pages whose keys lead
        ``page_keys`` (each taken by reference); returns how many."""
        if self._tables.get(request_id):
            raise RuntimeError(f"{request_id} already holds pages: match before growing")
        table: list[int] = []
        for key in page_keys:
            found = self.pool.lookup(key)
            if found is None:
                break
            table += found
        self._tables[request_id] = table
        return len(table)

    def count_pull(self, num_pages: int, num_held: int) -> None:
        """A migration's pull needs ``num_pages``, of which ``num_held`` are here already."""
        self.num_pulled_pages += num_pages - num_held
        self.num_held_pages += num_held

    def count_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Hit-rate accounting: a lookup for ``num_queried_tokens`` found ``num_hit_tokens``."""
        self.num_queried_tokens += num_queried_tokens
        self.num_hit_tokens += num_hit_tokens

    def register(self, request_id: str, page_keys: Sequence[str], first: int) -> None:
        """Make the request's pages ``first .. len(page_keys) - 1`` (written) findable by
        their keys. A key already cached keeps its pages; the request's copy stays private."""
        table = self._tables.get(request_id, [])
        for index in range(first, min(len(page_keys), len(table))):
            self.pool.register(page_keys[index], [table[index]])

    @property
    def num_cached_blocks(self) -> int:
        """Pages findable by key (in use or not)."""
        return self.pool.num_keyed
