"""Cache migration between instances (DESIGN.md §4): control messages + byte-moving backends."""

from typing import Literal, get_args

# Names the deployment API accepts (the CRD's enum). cuda_ipc and nccl move CUDA caches
# only (nccl also needs CuPy); the factory refuses them elsewhere with a clear error.
TransferBackendName = Literal["auto", "tcp", "shm", "collective", "cuda_ipc", "nccl"]
TRANSFER_BACKENDS: tuple[str, ...] = get_args(TransferBackendName)
AVAILABLE_TRANSFER_BACKENDS = TRANSFER_BACKENDS
GPU_TRANSFER_BACKENDS = ("cuda_ipc", "nccl")
