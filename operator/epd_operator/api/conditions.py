"""A status condition's value (``Ready``, ``Progressing``, ``Degraded``, ``Planned``): what the
decisions return and the status writers put in ``status.conditions[]`` with a timestamp and
``observedGeneration``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConditionState:
    status: str  # "True" | "False"
    reason: str
    message: str
