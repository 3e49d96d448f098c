"""Per-request page tables over the KV block pool."""

from __future__ import annotations

from epd_engine.cache.block_pool import BlockPool


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}

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

    def adopt(self, request_id: str, blocks: list[int]) -> None:
        """Take ownership of pages allocated elsewhere (a migration target's pull)."""
        self._tables.setdefault(request_id, []).extend(blocks)

    def release(self, request_id: str) -> None:
        blocks = self._tables.pop(request_id, None)
        if blocks:
            self.pool.free(blocks)
