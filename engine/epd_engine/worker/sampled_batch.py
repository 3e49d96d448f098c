"""A step's sampled tokens on their way from the device to the host.

The synchronous engine reads them back at once (``tolist``: the host waits for the GPU).
With async scheduling (``engine_inflight.py``) the engine launches the next step first:
the draws are copied into pinned memory behind the step's kernels and a CUDA event marks
their arrival, so ``result()`` waits only for what is not done yet. The device tensor stays
available meanwhile: the next step reads a request's pending token from it, on the device.
"""

from __future__ import annotations

import torch

from epd_engine.sampling import SampledToken


class SampledBatch:
    def __init__(
        self,
        tokens: torch.Tensor | None,  # [S] int64 on the device
        host: torch.Tensor | None = None,  # [S] its pinned host copy, in flight
        arrived: torch.cuda.Event | None = None,
        ready: list[SampledToken] | None = None,
    ) -> None:
        self.tokens = tokens
        self._host = host
        self._arrived = arrived
        self._ready = ready

    @classmethod
    def copying(cls, tokens: torch.Tensor) -> SampledBatch:
        """Start the copy to the host (on a CPU there is nothing to copy)."""
        if tokens.device.type != "cuda":
            return cls(tokens, host=tokens)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        arrived = torch.cuda.Event()
        arrived.record()
        return cls(tokens, host, arrived)

    @classmethod
    def ready(
        cls, tokens: list[SampledToken], on_device: torch.Tensor | None = None
    ) -> SampledBatch:
        """Already on the host (logprobs need the device's answer at once)."""
        return cls(on_device, ready=tokens)

    def result(self) -> list[SampledToken]:
        """The tokens, once on the host (waits for the device only if they are not)."""
        if self._ready is None:
            assert self._host is not None
            if self._arrived is not None:
                self._arrived.synchronize()  # releases the GIL while it waits
            self._ready = [SampledToken(t) for t in self._host.tolist()]
        return self._ready
