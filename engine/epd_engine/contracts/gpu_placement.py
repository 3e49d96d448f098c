"""Which GPU each local instance runs on (``epdctl up --device cuda``).

Each engine process sees one GPU through ``CUDA_VISIBLE_DEVICES`` (an instance uses one
device, as a pod with ``gpusPerInstance: 1`` does). With at least as many GPUs as instances
every instance gets its own; with fewer, up to ``per_gpu`` instances share one and each may
use ``memory_fraction / per_gpu`` of it, so their KV caches (sized from that share,
``kv_sizing.py``) cannot starve each other. A new instance goes to the least-loaded GPU.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    gpu: str  # an entry of the launcher's CUDA_VISIBLE_DEVICES, or an index
    memory_fraction: float

    def env(self) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": self.gpu}

    def args(self) -> list[str]:
        """``epdctl serve`` flags; placed last so they win over the deployment's."""
        return ["--device", "cuda", "--gpu-memory-fraction", f"{self.memory_fraction:.4g}"]


def visible_gpus(env: Mapping[str, str], device_count: Callable[[], int]) -> list[str]:
    """The GPUs this launcher may hand out: its own ``CUDA_VISIBLE_DEVICES``, else all."""
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [gpu.strip() for gpu in listed.split(",") if gpu.strip()]
    return [str(index) for index in range(device_count())]


class GpuSlots:
    def __init__(self, gpus: list[str], max_instances: int, memory_fraction: float = 0.9):
        if not gpus:
            raise ValueError("--device cuda but no GPU is visible (CUDA_VISIBLE_DEVICES, driver)")
        if max_instances < 1:
            raise ValueError(f"max_instances must be >= 1, got {max_instances}")
        self.gpus = list(gpus)
        self.per_gpu = math.ceil(max_instances / len(gpus))
        self.memory_fraction = memory_fraction
        self._holders: dict[str, list[str]] = {gpu: [] for gpu in self.gpus}

    def acquire(self, instance_id: str) -> Placement:
        """The least-loaded GPU (the first of equals); the same one again for a restart."""
        for gpu, holders in self._holders.items():
            if instance_id in holders:
                return self._placement(gpu)
        gpu = min(self.gpus, key=lambda g: len(self._holders[g]))
        if len(self._holders[gpu]) >= self.per_gpu:
            raise RuntimeError(
                f"no GPU slot left for {instance_id}: {len(self.gpus)} GPU(s) x {self.per_gpu} "
                "instances each are taken"
            )
        self._holders[gpu].append(instance_id)
        return self._placement(gpu)

    def release(self, instance_id: str) -> None:
        for holders in self._holders.values():
            if instance_id in holders:
                holders.remove(instance_id)

    def _placement(self, gpu: str) -> Placement:
        return Placement(gpu, self.memory_fraction / self.per_gpu)


def local_gpu_slots(max_instances: int, memory_fraction: float) -> GpuSlots:
    """Slots over the GPUs this process sees (``epdctl up --device cuda``)."""
    import torch

    return GpuSlots(visible_gpus(os.environ, torch.cuda.device_count), max_instances,
                    memory_fraction)  # fmt: skip
