"""Cache migration between instances (DESIGN.md §4): control messages + byte-moving backends."""

from typing import Literal, get_args

# Names the deployment API accepts (the CRD's enum); only the ones this build implements
# can start.
TransferBackendName = Literal["tcp", "cuda_ipc", "nccl"]
TRANSFER_BACKENDS: tuple[str, ...] = get_args(TransferBackendName)
AVAILABLE_TRANSFER_BACKENDS = ("tcp",)
