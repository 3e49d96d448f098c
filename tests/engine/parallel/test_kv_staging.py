"""Rank 0's staging pages (``parallel/kv_staging.py``): how they are taken and given back.

The page moves through them (gather, scatter over real gloo ranks) are checked end to end in
``tests/engine/disagg/test_tensor_parallel_methods.py``; here, the bookkeeping a burst of
migrations leans on, with no ranks (``PageCalls`` is never called by it)."""

from __future__ import annotations

import pytest
import torch

from epd_engine.parallel.kv_staging import KvStaging, StagingFull
from epd_engine.parallel.sizing import staging_pages
from epd_engine.transfer.backend import TransferError
from epd_engine.transfer.memory import SharedMemory


def make_staging(num_pages: int = 4) -> tuple[KvStaging, SharedMemory]:
    own = [torch.zeros(8, 2, 4, 1, 3) for _ in range(2)]  # 2 layers, 1 of 2 KV heads
    memory = SharedMemory()
    return KvStaging(own, 2, num_pages, memory, calls=None, group=None), memory  # type: ignore[arg-type]


def test_staging_takes_whole_heads_under_the_names_peers_map() -> None:
    staging, memory = make_staging()
    assert sorted(memory.regions) == ["kv.0", "kv.1"]
    assert [tuple(t.shape) for t in staging.layers] == [(4, 2, 4, 2, 3)] * 2


def test_a_page_keeps_its_staging_page_and_owners_never_share() -> None:
    staging, _ = make_staging()
    first = staging.stage("a", [5, 6])
    assert staging.stage("a", [6, 5]) == first[::-1]  # a later layer group: the same pages
    other = staging.stage("b", [5])
    assert set(other).isdisjoint(first)
    assert staging.num_free == 1


def test_too_few_free_pages_fail_the_migration_and_take_nothing() -> None:
    staging, _ = make_staging()
    staging.stage("a", [1, 2, 3])
    with pytest.raises(StagingFull, match="2 staging pages needed for b, 1 free"):
        staging.stage("b", [1, 2])
    assert issubclass(StagingFull, TransferError)  # the migration's usual failure path
    assert staging.num_free == 1
    staging.release("a")
    staging.release("a")  # twice, or for an owner with nothing, is harmless
    staging.release("nobody")
    assert staging.num_free == 4
    assert len(staging.stage("b", [1, 2])) == 2


def test_the_region_holds_one_longest_request_at_least() -> None:
    assert staging_pages(max_model_len=4096, block_size=16) == 8192 // 16
    assert staging_pages(max_model_len=32768, block_size=16) == 32768 // 16
