"""Whole-head copies of KV pages for migration, on rank 0 of a tensor-parallel instance.

Each rank holds its own KV heads of every page (``ranks.py``), and a transfer backend reads
and writes one process's tensors. So rank 0 keeps a region of *staging* pages that hold
every KV head, under the names an instance of one rank gives its KV cache (``kv.<layer>``),
and migration goes through it: a source gathers a parked request's pages from all ranks
into staging pages and offers those; a target pulls into staging pages and scatters each
landed layer range out to the ranks. Peers see a cache of whole heads whatever either
side's size, so every backend and every pair of sizes (1 to 8 on either side) work without
knowing ranks exist; the cost is one gather or scatter over the ranks' collective link per
migration, beside the model's all-reduces.

Staging pages are taken per request (its owner) and given back on its release; when none
are free the migration fails with ``TransferError`` (the source re-routes the request, the
target recomputes it), so a burst of hand-offs queues work, never corrupts it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from epd_engine.transfer.backend import TransferError
from epd_engine.transfer.memory import CacheMemory


class StagingFull(TransferError):
    """No staging pages are free for a migration: it fails and is re-routed or recomputed."""


class PageCalls(Protocol):
    """Rank 0's announcements of page moves to the other ranks (``ranks.RankLeader``)."""

    def gather_starts(self, pages: Sequence[int]) -> None: ...

    def scatter_starts(self, pages: Sequence[int], layer_start: int, layer_stop: int) -> None: ...

    def call_failed(self, exc: BaseException) -> Exception: ...


def page_shards(own: Sequence[torch.Tensor], pages: Sequence[int], start: int, stop: int
                ) -> torch.Tensor:  # fmt: skip
    """This rank's heads of ``pages`` in layers ``[start, stop)``: ``[layers, pages, 2, bs,
    H/N, D]``, one tensor for one collective."""
    index = torch.tensor(list(pages), dtype=torch.long, device=own[0].device)
    return torch.stack([own[layer].index_select(0, index) for layer in range(start, stop)])


def write_page_shards(
    own: Sequence[torch.Tensor], pages: Sequence[int], start: int, shards: torch.Tensor
) -> None:
    index = torch.tensor(list(pages), dtype=torch.long, device=own[0].device)
    for offset, layer_shards in enumerate(shards):
        own[start + offset].index_copy_(0, index, layer_shards)


def send_page_shards(own: Sequence[torch.Tensor], pages: Sequence[int], group: Any) -> None:
    """Ranks 1..N-1: their heads of ``pages`` in every layer, to rank 0 (``gather``)."""
    dist.gather(page_shards(own, pages, 0, len(own)), None, dst=0, group=group)


def receive_page_shards(
    own: Sequence[torch.Tensor], pages: Sequence[int], start: int, stop: int, group: Any
) -> None:
    """Ranks 1..N-1: their heads of ``pages`` in layers ``[start, stop)``, from rank 0."""
    shape = (stop - start, len(pages), *own[0].shape[1:])
    mine = torch.empty(shape, dtype=own[0].dtype, device=own[0].device)
    dist.scatter(mine, None, src=0, group=group)
    write_page_shards(own, pages, start, mine)


class KvStaging:
    """Rank 0's staging region and the page moves through it."""

    def __init__(
        self,
        own: Sequence[torch.Tensor],  # rank 0's KV cache: [blocks, 2, bs, H/N, D] per layer
        num_ranks: int,
        num_pages: int,
        memory: CacheMemory,
        calls: PageCalls,
        group: Any,
    ) -> None:
        _, two, block_size, heads, head_dim = own[0].shape
        self.own = list(own)
        self.num_ranks = num_ranks
        self.heads = heads  # per rank
        shape = (num_pages, two, block_size, heads * num_ranks, head_dim)
        self.layers = [memory.zeros(f"kv.{i}", shape, own[0].dtype) for i in range(len(own))]
        self._calls = calls
        self._group = group
        self._free = list(range(num_pages - 1, -1, -1))
        self._held: dict[str, dict[int, int]] = {}  # owner -> its cache page -> staging page
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    def stage(self, owner: str, pages: Sequence[int]) -> tuple[int, ...]:
        """The staging pages standing for ``owner``'s cache ``pages`` (taken on first sight;
        any thread). ``StagingFull`` when too few are free (nothing is taken then)."""
        with self._lock:
            held = self._held.setdefault(owner, {})
            new = [p for p in dict.fromkeys(pages) if p not in held]
            if len(new) > len(self._free):
                if not held:
                    del self._held[owner]
                raise StagingFull(
                    f"{len(new)} staging pages needed for {owner}, {len(self._free)} free "
                    "(migrations of this tensor-parallel instance in flight hold the rest)"
                )
            for page in new:
                held[page] = self._free.pop()
            return tuple(held[p] for p in pages)

    def release(self, owner: str) -> None:
        """Give back ``owner``'s staging pages (any thread; nothing held is fine)."""
        with self._lock:
            self._free += self._held.pop(owner, {}).values()

    def gather(self, pages: Sequence[int], staged: Sequence[int]) -> None:
        """Engine thread: every rank's heads of ``pages`` (all layers) into ``staged``."""
        self._calls.gather_starts(pages)
        try:
            mine = page_shards(self.own, pages, 0, len(self.own))
            parts = [torch.empty_like(mine) for _ in range(self.num_ranks)]
            dist.gather(mine, parts, dst=0, group=self._group)
        except Exception as exc:  # the other ranks are in this collective
            raise self._calls.call_failed(exc) from exc
        index = torch.tensor(list(staged), dtype=torch.long, device=mine.device)
        for rank, part in enumerate(parts):
            heads = slice(rank * self.heads, (rank + 1) * self.heads)
            for layer, shards in zip(self.layers, part, strict=True):
                layer[:, :, :, heads].index_copy_(0, index, shards)

    def scatter(self, staged: Sequence[int], pages: Sequence[int], start: int, stop: int) -> None:
        """Engine thread: ``staged`` pages of layers ``[start, stop)`` out to every rank's
        heads of ``pages``."""
        index = torch.tensor(list(staged), dtype=torch.long, device=self.own[0].device)
        parts = []
        for rank in range(self.num_ranks):
            heads = slice(rank * self.heads, (rank + 1) * self.heads)
            rows = [self.layers[layer].index_select(0, index)[:, :, :, heads]
                    for layer in range(start, stop)]  # fmt: skip
            parts.append(torch.stack(rows).contiguous())
        self._calls.scatter_starts(pages, start, stop)
        mine = torch.empty_like(parts[0])
        try:
            dist.scatter(mine, parts, src=0, group=self._group)
        except Exception as exc:
            raise self._calls.call_failed(exc) from exc
        write_page_shards(self.own, pages, start, mine)
