"""One GPU instance's memory plan: KV pages, the image cache, the activation reserve and the
budget search's largest probe, all from the model's shapes and the card's memory.

Pure (no device): the engine passes what ``torch.cuda.mem_get_info`` says, a test passes a
simulated card. The image cache is allocated after the KV pages are planned, so its bytes are
counted here as held already.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from epd_engine.worker.activation_reserve import StepShapes, plan_activations
from epd_engine.worker.kv_sizing import GpuMemory, kv_blocks_for_memory


@dataclass(frozen=True)
class MemoryPlan:
    kv_blocks: int
    kv_block_bytes: int
    image_cache_bytes: int
    reserve_bytes: int  # activations of the largest step (and workspaces)
    max_prefill_tokens: int  # the token-budget search probes no larger step

    def planned_bytes(self, memory: GpuMemory) -> int:
        """Everything this instance will hold: weights, caches and the largest step."""
        kv = self.kv_blocks * self.kv_block_bytes
        return memory.held_bytes + self.image_cache_bytes + kv + self.reserve_bytes


def plan_gpu_memory(
    config: Any,  # the family's parsed config
    element: int,  # bytes per value of the serving dtype
    memory: GpuMemory,  # the weights are loaded: ``held_bytes`` counts them
    memory_fraction: float,
    kv_block_size: int,
    image_cache_tokens: int,  # 0: this role keeps no image cache
    max_model_len: int,
    largest_image_tokens: int,
    prefills: bool,
    encodes: bool,
    staging_bytes: int = 0,  # rank 0 of a tensor-parallel instance: migrations' staging pages
) -> MemoryPlan:
    image_cache_bytes = image_cache_tokens * config.image_row_size * element
    held = replace(memory, held_bytes=memory.held_bytes + image_cache_bytes + staging_bytes)
    share = int(memory.total_bytes * memory_fraction) - held.held_bytes
    activations = plan_activations(
        StepShapes.of(config),
        element,
        share,
        max_model_len - 1,
        largest_image_tokens,
        prefills=prefills,
        encodes=encodes,
    )
    # K and V of every layer (kv_sizing.kv_block_bytes, in bytes rather than a dtype)
    block_bytes = config.num_layers * 2 * kv_block_size * config.num_kv_heads * config.head_dim
    block_bytes *= element
    blocks = kv_blocks_for_memory(held, block_bytes, memory_fraction, activations.reserve_bytes)
    return MemoryPlan(
        kv_blocks=blocks,
        kv_block_bytes=block_bytes,
        image_cache_bytes=image_cache_bytes,
        reserve_bytes=activations.reserve_bytes,
        max_prefill_tokens=activations.max_prefill_tokens,
    )
