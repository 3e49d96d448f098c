"""Operator settings from the environment (the only module that reads it; prefix ``EPD_``)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class OperatorSettings:
    resync_s: float = 10.0  # level-triggered timer interval
    router_timeout_s: float = 2.0  # internal API calls to the router

    @classmethod
    def from_env(cls) -> OperatorSettings:
        return cls(
            resync_s=float(os.environ.get("EPD_OPERATOR_RESYNC_S", cls.resync_s)),
            router_timeout_s=float(
                os.environ.get("EPD_OPERATOR_ROUTER_TIMEOUT_S", cls.router_timeout_s)
            ),
        )
