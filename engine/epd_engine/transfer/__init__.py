"""Cache migration between instances (DESIGN.md §4): control messages + byte-moving backends."""

from typing import Literal, get_args

# Names the deployment API accepts (the CRD's enum). cuda_ipc and nccl move CUDA caches
# only (nccl also needs CuPy); nixl moves either and needs NIXL (the nixl extra). The
# factory refuses them where they cannot run, with a clear error.
TransferBackendName = Literal["auto", "tcp", "shm", "collective", "cuda_ipc", "nccl", "nixl"]
TRANSFER_BACKENDS: tuple[str, ...] = get_args(TransferBackendName)
AVAILABLE_TRANSFER_BACKENDS = TRANSFER_BACKENDS
GPU_TRANSFER_BACKENDS = ("cuda_ipc", "nccl")
