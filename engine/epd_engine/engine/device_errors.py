"""Which step failures a device never recovers from: CUDA's "sticky" errors.

After these, CUDA's documentation says, "the process is left in an inconsistent state and any
further CUDA work will return the same error. To continue using CUDA, the process must be
terminated and relaunched." So are the ranks of a tensor-parallel instance once one of
them died or failed mid-call (``parallel/link.py``). An instance that meets one is broken:
it leaves routing and its probes fail, so the kubelet restarts it (``engine/health.py``).
Every other failure of a step (a request the step cannot take, a CUDA out-of-memory) fails
the requests concerned and the instance goes on (``LLMEngine._execute_isolated``).
"""

from __future__ import annotations

from epd_engine.parallel.link import RanksOutOfStep

# cudaGetErrorString's text of each sticky cudaError (CUDA runtime API), lower case; torch
# raises them as "CUDA error: <text>" (torch.AcceleratorError, a RuntimeError).
STICKY_CUDA_ERRORS = (
    "an illegal memory access was encountered",  # cudaErrorIllegalAddress
    "device-side assert triggered",  # cudaErrorAssert
    "unspecified launch failure",  # cudaErrorLaunchFailure
    "an illegal instruction was encountered",  # cudaErrorIllegalInstruction
    "misaligned address",  # cudaErrorMisalignedAddress
    "hardware stack error",  # cudaErrorHardwareStackError
    "invalid program counter",  # cudaErrorInvalidPc
    "operation not supported on global/shared address space",  # cudaErrorInvalidAddressSpace
    "the launch timed out and was terminated",  # cudaErrorLaunchTimeout
    "uncorrectable ecc error encountered",  # cudaErrorECCUncorrectable
    "uncorrectable nvlink error",  # cudaErrorNvlinkUncorrectable
    "cuda error: unknown error",  # what a GPU that fell off the bus (Xid 79) answers
)


def sticky_device_error(exc: BaseException) -> str | None:
    """The first line of ``exc``'s message when it (or an exception it was raised from) is a
    sticky device error, else None (the step's failure is its requests' alone)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, RanksOutOfStep):  # tensor-parallel ranks fell apart
            return f"tensor parallel: {current}"
        message = str(current)
        lowered = message.lower()
        if any(text in lowered for text in STICKY_CUDA_ERRORS):
            return message.strip().splitlines()[0] if message.strip() else type(current).__name__
        current = current.__cause__ or current.__context__
    return None
