"""Cache migration between instances (DESIGN.md §4): control messages + byte-moving backends."""

from typing import Literal, get_args

# Names the deployment API accepts (the CRD's enum); only the ones this build implements
# can start: cuda_ipc and nccl are the GPU build's (refused at start with a clear error).
TransferBackendName = Literal["auto", "tcp", "shm", "collective", "cuda_ipc", "nccl"]
TRANSFER_BACKENDS: tuple[str, ...] = get_args(TransferBackendName)
AVAILABLE_TRANSFER_BACKENDS = ("auto", "tcp", "shm", "collective")
