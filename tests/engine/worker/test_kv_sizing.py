"""KV pages from a GPU's memory: the instance's share less its weights and a reserve, capped by
what is free (pure arithmetic; the CUDA query itself is exercised by the gpu tests)."""

from __future__ import annotations

import pytest
import torch

from epd_engine.worker.kv_sizing import GpuMemory, kv_block_bytes, kv_blocks_for_memory

GIB = 1 << 30


def test_block_bytes_of_llava_7b() -> None:
    # 32 layers x K,V x 16 tokens x 32 heads x 128 x 2 bytes = 8 MiB per page (512 KiB/token)
    assert kv_block_bytes(32, 16, 32, 128, torch.float16) == 8 << 20


def test_share_less_weights_and_reserve() -> None:
    memory = GpuMemory(total_bytes=80 * GIB, free_bytes=66 * GIB, held_bytes=14 * GIB)
    blocks = kv_blocks_for_memory(memory, 8 << 20, memory_fraction=0.9, reserve_bytes=2 * GIB)
    assert blocks == int((80 * GIB * 0.9 - 16 * GIB) // (8 << 20))  # 7168 pages, 56 GiB


def test_capped_by_free_memory_when_another_process_holds_it() -> None:
    memory = GpuMemory(total_bytes=80 * GIB, free_bytes=20 * GIB, held_bytes=14 * GIB)
    blocks = kv_blocks_for_memory(memory, 8 << 20, memory_fraction=0.9, reserve_bytes=2 * GIB)
    assert blocks == int((20 * GIB * 0.95 - 2 * GIB) // (8 << 20))


def test_two_instances_sharing_a_gpu_split_it() -> None:
    memory = GpuMemory(total_bytes=80 * GIB, free_bytes=80 * GIB, held_bytes=0)
    whole = kv_blocks_for_memory(memory, 8 << 20, memory_fraction=0.9, reserve_bytes=0)
    half = kv_blocks_for_memory(memory, 8 << 20, memory_fraction=0.45, reserve_bytes=0)
    assert half == whole // 2


def test_too_small_a_share_is_a_clear_error() -> None:
    memory = GpuMemory(total_bytes=24 * GIB, free_bytes=24 * GIB, held_bytes=14 * GIB)
    with pytest.raises(ValueError, match=r"only 0 KV pages fit.*--gpu-memory-fraction"):
        kv_blocks_for_memory(memory, 8 << 20, memory_fraction=0.5)
    with pytest.raises(ValueError, match="memory fraction"):
        kv_blocks_for_memory(memory, 8 << 20, memory_fraction=1.5)
