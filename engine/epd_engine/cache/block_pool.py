"""A pool of fixed-size pages with reference counts and optional content addressing.

Pages with a content key (an image hash, a KV page's prefix key) stay cached after their
last user frees them and are evicted least-recently-used only when a new allocation needs
room. That is what turns the image cache into the encoder-output cache (a repeated image
finds its pages again) and the KV cache into a prefix cache (``kv_cache.py``).
"""

from __future__ import annotations

from collections import OrderedDict

# Free pages are a list read from ``_head`` on (first freed, first reused): an allocation
# takes a slice, not one ``popleft`` a page (the simulator moves ~1.6 M pages in a 256-GPU
# plan search). The consumed head is dropped once it is this long and half the list.
_COMPACT_AT = 4096


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks))  # free from _head on
        self._head = 0
        self._ref_counts = [0] * num_blocks
        self._by_key: dict[str, tuple[int, ...]] = {}
        self._key_of: dict[int, str] = {}
        # keyed page groups nobody references, oldest first: evictable
        self._evictable: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._num_evictable = 0  # pages in _evictable (num_free is hot: every load report)

    @property
    def num_free(self) -> int:
        """Pages an allocation can get right now (free plus evictable cached ones)."""
        return len(self._free) - self._head + self._num_evictable

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def can_allocate(self, num: int) -> bool:
        return num <= self.num_free

    def allocate(self, num: int) -> list[int] | None:
        """``num`` pages with one reference each, or None (and no change) if they don't fit."""
        free, head = self._free, self._head
        if num > len(free) - head + self._num_evictable:
            return None
        while len(free) - head < num:
            self._evict_oldest()
        blocks = free[head : head + num]
        head += num
        if head >= _COMPACT_AT and 2 * head >= len(free):
            del free[:head]
            head = 0
        self._head = head
        ref_counts = self._ref_counts
        for block in blocks:
            ref_counts[block] = 1
        return blocks

    def free(self, blocks: list[int] | tuple[int, ...]) -> None:
        """Drop one reference from each page; unreferenced pages become free or evictable."""
        ref_counts, key_of, free = self._ref_counts, self._key_of, self._free
        if not key_of:  # nothing is cached (no prefix cache, or nothing registered yet)
            for block in blocks:
                count = ref_counts[block]
                if count == 1:
                    ref_counts[block] = 0
                    free.append(block)
                elif count > 1:
                    ref_counts[block] = count - 1
                else:
                    raise RuntimeError(f"double free of block {block}")
            return
        for block in blocks:
            count = ref_counts[block]
            if count <= 0:
                raise RuntimeError(f"double free of block {block}")
            ref_counts[block] = count - 1
            if count == 1 and block not in key_of:
                free.append(block)
        # in the order freed: the first to become evictable is the first evicted
        for key in dict.fromkeys(key_of[b] for b in blocks if b in key_of):
            group = self._by_key[key]
            if all(self._ref_counts[b] == 0 for b in group) and key not in self._evictable:
                self._evictable[key] = group
                self._num_evictable += len(group)

    def register(self, key: str, blocks: list[int]) -> None:
        """Make ``blocks`` (already referenced by the caller) findable by ``key``."""
        if key in self._by_key or any(block in self._key_of for block in blocks):
            return  # first writer wins; the duplicate pages stay private to their request
        group = tuple(blocks)
        self._by_key[key] = group
        for block in group:
            self._key_of[block] = key

    def lookup(self, key: str) -> list[int] | None:
        """Pages cached under ``key`` with a new reference taken, or None."""
        group = self._by_key.get(key)
        if group is None:
            return None
        if self._evictable.pop(key, None) is not None:
            self._num_evictable -= len(group)
        for block in group:
            self._ref_counts[block] += 1
        return list(group)

    def contains(self, key: str) -> bool:
        return key in self._by_key

    @property
    def num_keyed(self) -> int:
        """Pages findable by a key, referenced or not."""
        return len(self._key_of)

    def _evict_oldest(self) -> None:
        key, group = self._evictable.popitem(last=False)
        self._num_evictable -= len(group)
        del self._by_key[key]
        for block in group:
            del self._key_of[block]
            self._free.append(block)
