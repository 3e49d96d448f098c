"""Small host lists onto the GPU without making the host wait for it.

A blocking host-to-device copy (``torch.tensor(values, device="cuda")``, or indexing a CUDA
tensor with a Python list, which copies the list that way) synchronises the stream: the
host waits for every kernel queued before it. With async scheduling that is the whole step
in flight, so one such copy in a launch puts the host back in step with the GPU. A copy
from pinned memory with ``non_blocking`` is queued like a kernel instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[object], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``, copied without a wait (on a CPU: in place)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
