"""Cache migration between instances (DESIGN.md §4): control messages + byte-moving backends."""

# Names the deployment API accepts; only the ones this build implements can start.
TRANSFER_BACKENDS = ("tcp", "cuda_ipc", "nccl")
AVAILABLE_TRANSFER_BACKENDS = ("tcp",)
