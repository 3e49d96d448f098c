"""Why the loop decided what it did at its last re-plan, as the status shows it (Auto mode).

Numbers are decimal strings (no floats in the API), empty where not known: no trace window
read, or a fixed size (no target).
"""

from __future__ import annotations

from pydantic import Field

from epd_operator.api.model_base import SpecModel


class PlanDecision(SpecModel):
    time: str = Field(description="RFC 3339 time of the decision.")
    outcome: str = Field(
        description="The Planned condition's reason: ScaledUp, ScaleDownPending, PlanConfirmed, "
        "FastScaledUp (the fast path), ..."
    )
    alarm: str = Field(
        default="", description="Fast path only: the SLO alarm it reacted to, with its numbers."
    )
    stage: str = Field(default="", description="Fast path only: the bottleneck stage.")
    plan_before: str = Field(
        default="", description="Fast path only: the plan it grew, e.g. `E+P+D 1E1P1D`."
    )
    rate_seen_rps: str = Field(default="", description="The trace window's mean request rate.")
    newest_rate_rps: str = Field(default="", description="The newest sub-window's rate.")
    trend_rps_per_minute: str = Field(
        default="", description="Theil-Sen slope of the sub-windows' rates."
    )
    horizon_seconds: int | None = Field(
        default=None, ge=0, description="How far ahead the forecast looks (the rollout time)."
    )
    horizon_source: str = Field(
        default="", description="`last switch` (measured) or `default` (none measured yet)."
    )
    forecast_rps: str = Field(default="", description="The rate expected once the plan serves.")
    forecast_rule: str = Field(
        default="", description="What set it: the trend, or the stabilisation window's peak."
    )
    target_rps: str = Field(
        default="", description="Forecast x (1 + headroomPercent/100); elastic capacity only."
    )
    plan: str = Field(description="The plan run after the decision, e.g. `E+P+D 1E2P1D`.")
    predicted_goodput_rps: str = Field(default="", description="Its simulated goodput.")
    instances: int = Field(ge=0)
    gpus: int = Field(ge=0)
    message: str = Field(default="", description="The Planned condition's message.")
