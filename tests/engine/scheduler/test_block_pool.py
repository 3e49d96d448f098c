"""BlockPool's page accounting: ``num_free`` (kept as a running count, it is read on every
load report) always equals free pages plus cached pages nobody references."""

from __future__ import annotations

import random

from epd_engine.cache.block_pool import BlockPool


def _recount(pool: BlockPool) -> int:
    return len(pool._free) + sum(len(group) for group in pool._evictable.values())


def test_num_free_counts_free_and_evictable_pages_through_random_use() -> None:
    rng = random.Random(0)
    pool = BlockPool(32)
    held: list[tuple[str | None, list[int]]] = []
    for step in range(2000):
        action = rng.random()
        if action < 0.45:  # allocate, sometimes content-addressed (an image)
            key = f"img{rng.randrange(12)}" if rng.random() < 0.6 else None
            found = pool.lookup(key) if key is not None else None
            if found is not None:
                held.append((key, found))
            elif (blocks := pool.allocate(rng.randint(1, 4))) is not None:
                if key is not None:
                    pool.register(key, blocks)
                held.append((key, blocks))
        elif held:
            _, blocks = held.pop(rng.randrange(len(held)))
            pool.free(blocks)
        assert pool.num_free == _recount(pool), f"step {step}"
    for _, blocks in held:
        pool.free(blocks)
    assert pool.num_free == pool.num_blocks
