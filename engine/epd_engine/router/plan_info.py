"""The plan the router serves, as the ``epd_plan_info`` metric (dashboards show its labels)."""

from __future__ import annotations

from collections.abc import Mapping

from epd_engine.contracts.plan import Plan
from epd_engine.metrics import Metrics


def plan_labels(plan: Mapping[str, object]) -> dict[str, str]:
    """``epd_plan_info`` labels of a plan as the operator sends it (``Plan`` fields, plus
    extras such as ``pool_names`` that are not labels); ValueError if it is not a plan."""
    fields = {k: v for k, v in plan.items() if k in Plan.model_fields}
    parsed = Plan.model_validate(fields)
    predicted = parsed.predicted
    return {
        "method": parsed.method.value,
        "pools": parsed.describe().split(" ", 1)[1],
        "reason": parsed.reason,
        "predicted_goodput_rps": f"{predicted.goodput_rps:.2f}" if predicted else "",
    }


def publish_plan(metrics: Metrics, labels: Mapping[str, str]) -> None:
    metrics.plan.labels(**metrics.labels).info(dict(labels))
