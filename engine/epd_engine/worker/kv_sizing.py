"""How many KV pages an instance gets: a fixed count on CPU, its share of the GPU on CUDA.

On a GPU the cache takes what the instance's share of the card leaves once the weights are
loaded (vLLM's ``gpu_memory_utilization``): ``total x memory_fraction`` less what this
process already holds (weights, the image cache, decode buffers) less a reserve for the
activations of the largest step. Several instances placed on one GPU by ``epdctl up`` split
the fraction between them, so they cannot starve each other. The figure is also capped by
what is free now, because another process may hold memory this one does not know about.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CPU_KV_BLOCKS = 512  # a CPU instance's default: the tiny model's pages are cheap
DEFAULT_MEMORY_FRACTION = 0.9
# a caller's default where no model is at hand; the engine counts its own from the model's
# shapes (activation_reserve.py, memory_plan.py)
ACTIVATION_RESERVE_BYTES = 2 << 30
FREE_MARGIN = 0.95  # never plan on the last 5% of what is free: allocator fragmentation
MIN_KV_BLOCKS = 16


@dataclass(frozen=True)
class GpuMemory:
    total_bytes: int
    free_bytes: int
    held_bytes: int  # what this process has allocated already


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype) -> int:  # fmt: skip
    """One page across every layer: K and V, ``block_size`` tokens each."""
    element = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * element


def kv_blocks_for_memory(
    memory: GpuMemory,
    block_bytes: int,
    memory_fraction: float = DEFAULT_MEMORY_FRACTION,
    reserve_bytes: int = ACTIVATION_RESERVE_BYTES,
) -> int:
    """Pages that fit this instance's share of the GPU; ``ValueError`` (with the figures)
    when fewer than ``MIN_KV_BLOCKS`` fit, rather than an out-of-memory error later."""
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory fraction must be in (0, 1], got {memory_fraction}")
    share = int(memory.total_bytes * memory_fraction) - memory.held_bytes - reserve_bytes
    budget = min(share, int(memory.free_bytes * FREE_MARGIN) - reserve_bytes)
    blocks = max(budget, 0) // block_bytes
    if blocks < MIN_KV_BLOCKS:
        gib = 1 << 30
        raise ValueError(
            f"only {blocks} KV pages fit: the GPU has {memory.total_bytes / gib:.1f} GiB, "
            f"{memory.free_bytes / gib:.1f} GiB free, this instance's share is "
            f"{memory_fraction:g} and its weights hold {memory.held_bytes / gib:.1f} GiB "
            f"(+{reserve_bytes / gib:.1f} GiB reserved for activations); give it a larger "
            "share (--gpu-memory-fraction), a GPU of its own, or --num-kv-blocks"
        )
    return blocks


def cuda_memory(device: torch.device) -> GpuMemory:
    free, total = torch.cuda.mem_get_info(device)
    return GpuMemory(total, free, torch.cuda.memory_allocated(device))
