"""BlockPool's page accounting: ``num_free`` (kept as a running count, it is read on every
load report) always equals free pages plus cached pages nobody references."""

from __future__ import annotations

import random

from epd_engine.cache.block_pool import BlockPool


def _recount(pool: BlockPool) -> int:
    free = len(pool._free) - pool._head  # the list is read from _head on
    return free + sum(len(group) for group in pool._evictable.values())


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


def test_pages_are_reused_first_freed_first_across_compactions() -> None:
    """The free list is a list read from a head index (a slice per allocation, not a
    ``popleft`` per page); it must hand out exactly the pages a FIFO queue would, also after
    the consumed head is dropped (from 4,096 pages on)."""
    from collections import deque

    rng = random.Random(1)
    pool = BlockPool(6000)
    fifo = deque(range(6000))
    held: list[list[int]] = []
    compactions = 0
    for _ in range(20000):
        if rng.random() < 0.5 and len(fifo) >= 64:
            n = rng.randint(1, 64)
            head = pool._head
            blocks = pool.allocate(n)
            compactions += pool._head < head
            assert blocks == [fifo.popleft() for _ in range(n)]
            held.append(blocks)
        elif held:
            blocks = held.pop(rng.randrange(len(held)))
            pool.free(blocks)
            fifo.extend(blocks)
        assert pool.num_free == len(fifo)
    assert compactions > 0
    for blocks in held:
        pool.free(blocks)
    assert pool.num_free == 6000
