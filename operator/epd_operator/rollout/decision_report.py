"""Each decision of the loop as a Kubernetes Event (``epdctl up``: a log line), the same for
both backends: the reason is the decision's outcome (``ScaledUp``, ``PlanConfirmed``, ...),
the message ``describe_decision``'s line (rate seen, forecast, target, plan, goodput, GPUs).
"""

from __future__ import annotations

from collections.abc import Callable

from epd_operator.api.decision_status import PlanDecision
from epd_operator.planning.decision import describe_decision
from epd_operator.planning.plan_pass import PlanPassResult

PostEvent = Callable[[str, str, str], None]  # (type, reason, message)
# A re-plan due while the plan changed recently and the planner did not run: the note is
# repeated every pass until the cooldown ends; not a decision of its own.
HELD_BACK = "Cooldown"


def pass_decision(passed: PlanPassResult) -> PlanDecision | None:
    """The decision this pass made (the re-plan ran, or news such as the fast path's
    scale-up), None when it made none."""
    ran = passed.planner_s is not None
    news = passed.note is not None and passed.note.reason != HELD_BACK
    return passed.memory.decision if ran or news else None


def post_decision(post_event: PostEvent, decision: PlanDecision) -> None:
    kind = "Warning" if decision.outcome == "SearchFailed" else "Normal"
    post_event(kind, decision.outcome, describe_decision(decision))
