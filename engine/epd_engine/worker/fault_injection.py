"""Test-only device faults, so a CPU machine can exercise what a broken GPU does.

``EPD_FAULT_INJECT`` (read in ``config.py``, validated with the engine's config) names one:

- ``device_error_after_steps:N``: the first N steps run; from then on every step raises
  CUDA's sticky illegal-address error, as a GPU does after a bad kernel or an ECC fault.
- ``hang_after_steps:N``: the first N steps run; the next never returns, as a step stuck on
  a hung device.

Unset (the default) nothing is injected. Only ``ModelRunner.launch`` (a serving step)
counts: the start-up budget search runs no injected fault.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

FAULTS = ("device_error_after_steps", "hang_after_steps")
INJECTED_DEVICE_ERROR = (
    "CUDA error: an illegal memory access was encountered (injected by EPD_FAULT_INJECT)"
)
HANG_S = 24 * 3600.0


@dataclass(frozen=True)
class FaultSpec:
    fault: str
    after_steps: int

    @classmethod
    def parse(cls, text: str) -> FaultSpec | None:
        """``"<fault>:<steps>"``; empty: None. Raises ValueError naming what is wrong."""
        if not text:
            return None
        fault, _, steps = text.partition(":")
        if fault not in FAULTS:
            raise ValueError(f"fault injection must be one of {', '.join(FAULTS)}, got {fault!r}")
        try:
            after_steps = int(steps)
        except ValueError:
            raise ValueError(f"fault injection {text!r}: give the steps as {fault}:N") from None
        if after_steps < 0:
            raise ValueError(f"fault injection {text!r}: steps must be >= 0")
        return cls(fault, after_steps)


class FaultInjector:
    """Counts the steps launched and injects the fault when its step comes."""

    def __init__(self, spec: FaultSpec | None) -> None:
        self.spec = spec
        self.num_steps = 0
        self.unhang = threading.Event()  # ends an injected hang (an in-process test's exit)

    def before_step(self) -> None:
        spec = self.spec
        if spec is None:
            return
        self.num_steps += 1
        if self.num_steps <= spec.after_steps:
            return
        if spec.fault == "device_error_after_steps":
            raise RuntimeError(INJECTED_DEVICE_ERROR)
        self.unhang.wait(HANG_S)  # hang_after_steps
        raise RuntimeError("injected hang ended")
