"""The record of one re-plan's decision for the status: the rate seen, the forecast, the
target (forecast x headroom), the plan run after it, its predicted goodput and its GPUs; and
of a fast-path scale-up: the alarm, the stage, the plan before and after."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from epd_engine.contracts.plan import Plan
from epd_operator.api.conditions import ConditionState
from epd_operator.api.decision_status import PlanDecision
from epd_operator.api.spec import EPDDeploymentSpec
from epd_operator.planning.choice import WorkloadStats
from epd_operator.planning.fast_path import FastStep
from epd_operator.planning.forecast import Forecast
from epd_operator.planning.planner import target_rate

FAST_SCALED_UP = "FastScaledUp"  # the Planned reason of a fast-path decision


def _stamp(now: datetime) -> str:
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _rps(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def _forecast_fields(forecast: Forecast | None, horizon_source: str) -> dict[str, Any]:
    if forecast is None:  # no trace window read
        return {}
    return {
        "newest_rate_rps": _rps(forecast.newest_rps),
        "trend_rps_per_minute": f"{forecast.trend_rps_per_s * 60:+.3f}",
        "horizon_seconds": round(forecast.horizon_s),
        "horizon_source": horizon_source,
        "forecast_rps": _rps(forecast.forecast_rps),
        "forecast_rule": forecast.rule,
    }


def decision_record(
    spec: EPDDeploymentSpec,
    now: datetime,
    note: ConditionState | None,
    plan: Plan,
    stats: WorkloadStats | None,
    forecast: Forecast | None,
    horizon_source: str,
) -> PlanDecision:
    """What ``status.decision`` holds after a pass whose re-plan ran (or was held back)."""
    predicted = plan.predicted
    return PlanDecision(
        time=_stamp(now),
        outcome=note.reason if note is not None else "Planned",
        rate_seen_rps=_rps(stats.request_rate_rps if stats is not None else None),
        target_rps=_rps(target_rate(spec, stats)),
        plan=plan.describe(),
        predicted_goodput_rps=_rps(predicted.goodput_rps if predicted is not None else None),
        instances=plan.num_instances,
        gpus=plan.num_ranks * spec.engine.gpus_per_instance,
        message=note.message if note is not None else plan.reason,
        **_forecast_fields(forecast, horizon_source),
    )


def fast_decision_record(spec: EPDDeploymentSpec, now: datetime, step: FastStep) -> PlanDecision:
    """What ``status.decision`` holds after a fast-path scale-up: the alarm, the stage, the
    plan before and after (no rate or prediction: no re-plan ran)."""
    return PlanDecision(
        time=_stamp(now),
        outcome=FAST_SCALED_UP,
        alarm=step.alarm.reason,
        stage=str(step.alarm.stage),
        plan_before=step.before.describe(),
        plan=step.after.describe(),
        instances=step.after.num_instances,
        gpus=step.after.num_ranks * spec.engine.gpus_per_instance,
        message=step.after.reason,
    )


def describe_decision(d: PlanDecision) -> str:
    """One line for ``epdctl status``: from the rate seen to the plan and its GPUs."""
    if d.alarm:
        return (
            f"{d.outcome} at {d.time}: {d.alarm} -> {d.stage} bottleneck: {d.plan_before} -> "
            f"{d.plan}, {d.gpus} GPUs"
        )
    seen = f"rate seen {d.rate_seen_rps or '?'} rps"
    if d.forecast_rps:
        seen += (
            f", forecast {d.forecast_rps} rps {d.horizon_seconds} s ahead (horizon: "
            f"{d.horizon_source}; set by: {d.forecast_rule}; trend {d.trend_rps_per_minute} "
            "rps/min)"
        )
    if d.target_rps:
        seen += f", target {d.target_rps} rps (x headroom)"
    goodput = (
        f", predicted goodput {d.predicted_goodput_rps} rps" if d.predicted_goodput_rps else ""
    )
    return f"{d.outcome} at {d.time}: {seen} -> {d.plan}{goodput}, {d.gpus} GPUs"
