"""The engine images an EPDDeployment runs when it names none (``engine.image`` unset).

``docker/engine.Dockerfile`` builds both from one file: ``epd-engine`` (CPU; torch from PyPI
is its CUDA build, so it runs on a GPU too, without FlashInfer) and ``epd-engine-gpu``
(``VARIANT=gpu``: FlashInfer with its kernels built in, CuPy for NCCL, NVML; an NVIDIA driver
>= 580 on the node). Instances with a GPU get the GPU image; the router, which runs no GPU code,
gets the CPU one.
"""

from __future__ import annotations

ENGINE_IMAGE = "epd-engine:0.1.0"
GPU_ENGINE_IMAGE = "epd-engine-gpu:0.1.0"


def default_engine_image(gpus_per_instance: int) -> str:
    """The image of an instance with ``gpus_per_instance`` GPUs when the spec names none."""
    return GPU_ENGINE_IMAGE if gpus_per_instance >= 1 else ENGINE_IMAGE
