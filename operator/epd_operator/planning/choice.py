"""Pure decisions: which plan to run (Fixed, or Auto: when to re-plan, the margin a new plan
must beat the current one by, re-simulated on the same window, and the cooldown), and the
heuristic plan used until the trace holds enough requests for the profiler."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from epd_engine.config import Role
from epd_engine.contracts.plan import Plan
from epd_operator.api.conditions import ConditionState
from epd_operator.api.spec import EPDDeploymentSpec, PlanStatus, fixed_plan


@dataclass(frozen=True)
class WorkloadStats:
    """The live workload over the profiler's trace window (the router's trace, or Prometheus)."""

    num_requests: int
    request_rate_rps: float
    mean_prompt_tokens: float | None = None  # None: not exported by the router (yet)
    mean_images: float | None = None
    mean_output_tokens: float | None = None
    slo_attainment: float | None = None  # share of requests meeting both SLOs
    window_s: float | None = None  # the seconds the trace window covers (None: not a trace)
    forecast_rps: float | None = None  # the rate expected once a plan serves (``forecast``)


class PlanningError(RuntimeError):
    """The planner produced no plan (no trace, no feasible plan, time limit, crash); says why."""


@dataclass(frozen=True)
class Proposal:
    """A planner's best plan, and the current plan's goodput re-simulated on the same window
    (None when not simulated, e.g. the heuristic)."""

    plan: Plan
    current_goodput_rps: float | None = None
    num_simulations: int | None = None  # the search's work (None: no search ran)


# Makes a plan from the spec, the live workload and the current plan (None: the first plan);
# raises PlanningError when it cannot. ``heuristic_planner`` is one; the operator passes
# ``planner.auto_planner(...)``, which holds the trace window and the cost model and runs the
# trace-replay profiler, re-simulating the current plan on the same window.
Planner = Callable[[EPDDeploymentSpec, WorkloadStats | None, Plan | None], Proposal]


@dataclass(frozen=True)
class PlanChoice:
    plan: Plan
    ran: bool  # the planner ran (the controller records when)
    note: ConditionState | None = None  # the ``Planned`` condition, when there is news


def instances_allowed(spec: EPDDeploymentSpec) -> int:
    """Most instances the loop plans for: ``capacity.maxGPUs`` (unset: the GPU budget) pays
    for (at least one: a CPU engine needs no GPU)."""
    return instance_range(spec)[1]


def instance_range(spec: EPDDeploymentSpec) -> tuple[int, int]:
    """Fewest and most instances a plan may have (``spec.capacity``; equal: a fixed size)."""
    per_instance = max(spec.engine.gpus_per_instance, 1)
    capacity = spec.capacity
    max_gpus = capacity.max_gpus if capacity.max_gpus is not None else spec.gpu_budget
    min_gpus = capacity.min_gpus if capacity.min_gpus is not None else max_gpus
    most = max(max_gpus // per_instance, 1)
    return min(max(min_gpus // per_instance, 1), most), most


def is_elastic(spec: EPDDeploymentSpec) -> bool:
    low, high = instance_range(spec)
    return low < high


def budget_changed(spec: EPDDeploymentSpec, current: PlanStatus) -> bool:
    """The plan's instances are outside what the capacity allows now (the range moved)."""
    low, high = instance_range(spec)
    return not low <= current.to_plan().num_ranks <= high


def heuristic_plan(spec: EPDDeploymentSpec, stats: WorkloadStats | None, why: str = "") -> Plan:
    """The ``mode: Auto`` plan when the trace-replay profiler cannot run (``why`` says why,
    e.g. no trace yet). Splits the instances the budget allows in proportion to rough
    per-stage work: image count for E, prompt tokens for P, output tokens for D (decode
    weighted 2x: memory-bound)."""
    from epd_engine.config import Method

    n = instances_allowed(spec)
    note = f" ({why})" if why else ""
    if stats is not None and stats.num_requests > 0 and stats.mean_images == 0:
        return _text_only_plan(n, stats, note)
    if n <= 1:
        return Plan(
            method=Method.EPD, pools={Role.EPD: 1}, reason="budget fits one instance" + note
        )
    if n == 2:
        return Plan(
            method=Method.EP_D, pools={Role.EP: 1, Role.D: 1}, reason="budget fits two" + note
        )
    images = stats.mean_images if stats and stats.mean_images is not None else 1.0
    prompt = stats.mean_prompt_tokens if stats and stats.mean_prompt_tokens is not None else 512.0
    output = stats.mean_output_tokens if stats and stats.mean_output_tokens is not None else 256.0
    work_e, work_p, work_d = images * 576, prompt, 2 * output
    total = work_e + work_p + work_d or 1.0
    counts = {r: max(1, int(n * w / total)) for r, w in ((Role.E, work_e), (Role.P, work_p))}
    counts[Role.D] = max(1, n - counts[Role.E] - counts[Role.P])
    while sum(counts.values()) > n:
        biggest = max(counts, key=lambda r: counts[r])
        counts[biggest] -= 1
    if stats is not None and stats.num_requests > 0:
        reason = f"heuristic split of the GPU budget on {stats.num_requests} requests{note}"
    else:
        reason = "heuristic split of the GPU budget (no trace yet" + (f": {why})" if why else ")")
    return Plan(method=Method.E_P_D, pools=counts, reason=reason)


def _text_only_plan(n: int, stats: WorkloadStats, note: str) -> Plan:
    """No image in the window: no encode pool. EP+D split by prompt vs output work (EP runs
    prefill; it would run encode only if images came back)."""
    from epd_engine.config import Method

    why = f"text-only traffic: no encode pool{note}"
    if n <= 1:
        return Plan(method=Method.EPD, pools={Role.EPD: 1}, reason=why)
    prompt = stats.mean_prompt_tokens if stats.mean_prompt_tokens is not None else 512.0
    output = stats.mean_output_tokens if stats.mean_output_tokens is not None else 256.0
    ep = min(n - 1, max(1, round(n * prompt / (prompt + 2 * output))))
    return Plan(method=Method.EP_D, pools={Role.EP: ep, Role.D: n - ep}, reason=why)


def heuristic_planner(
    spec: EPDDeploymentSpec, stats: WorkloadStats | None, current: Plan | None
) -> Proposal:
    return Proposal(heuristic_plan(spec, stats))


def workload_shift_percent(before: WorkloadStats, now: WorkloadStats) -> float:
    """Largest relative change (in %) of rate, prompt length, images or output length."""
    pairs = [
        (before.request_rate_rps, now.request_rate_rps),
        (before.mean_prompt_tokens, now.mean_prompt_tokens),
        (before.mean_images, now.mean_images),
        (before.mean_output_tokens, now.mean_output_tokens),
    ]
    return max(
        abs(b - a) / max(abs(a), 1e-9) * 100 for a, b in pairs if a is not None and b is not None
    )


def replan_due(
    spec: EPDDeploymentSpec, current: PlanStatus | None, seconds_since_plan: float
) -> bool:
    """Whether ``choose_plan`` may call the planner this pass (Auto): no plan yet, the GPU
    budget changed, or the interval passed. The operator reads the workload only then."""
    if spec.disaggregation.mode == "Fixed":
        return False
    return (
        current is None
        or budget_changed(spec, current)
        or seconds_since_plan >= spec.profiler.interval_seconds
    )


def choose_plan(
    spec: EPDDeploymentSpec,
    current: PlanStatus | None,
    stats: WorkloadStats | None,
    planned_on: WorkloadStats | None,
    seconds_since_plan: float,
    planner: Planner = heuristic_planner,
    seconds_since_change: float = float("inf"),
) -> PlanChoice:
    """The plan to run now. Fixed: the spec's. Auto: ``planner`` makes the first plan and a
    new one when the GPU budget changed. Otherwise the planner runs only when the interval
    passed, the window has enough requests, and the workload shifted enough or the live SLO
    attainment fell below the target; and its plan replaces the current one only if the
    cooldown since the last change passed and it beats the current plan (re-simulated on the
    same window) by ``switchMarginPercent``. A failed search keeps the current plan.

    With an elastic ``spec.capacity`` the planner also sizes the plan: one with more
    instances replaces the current one at once (the cooldown does not hold it back), one with
    fewer only once ``scaleDownStabilizationSeconds`` have passed since the last change; the
    cooldown and the margin apply to a switch at the same size."""
    if spec.disaggregation.mode == "Fixed":
        return PlanChoice(fixed_plan(spec), False)
    if current is None or budget_changed(spec, current):
        try:
            plan = planner(spec, stats, None).plan
        except PlanningError as exc:
            plan = heuristic_plan(spec, stats, f"planner gave no plan: {exc}")
        return PlanChoice(plan, True, ConditionState("True", "Planned", plan.reason))
    prof = spec.profiler
    now_plan = current.to_plan()
    due = (
        stats is not None
        and seconds_since_plan >= prof.interval_seconds
        and stats.num_requests >= prof.min_requests
        and (
            planned_on is None
            or workload_shift_percent(planned_on, stats) >= prof.shift_threshold_percent
            or (
                stats.slo_attainment is not None
                and stats.slo_attainment * 100 < spec.slo.attainment_percent
            )
        )
    )
    if not due:
        return PlanChoice(now_plan, False)
    # an elastic capacity re-plans through the cooldown: a scale-up must not wait for it (the
    # cooldown then holds back only a switch at the same size, below)
    elastic = is_elastic(spec)
    cooling = seconds_since_change < prof.cooldown_seconds
    if cooling and not elastic:
        return PlanChoice(
            now_plan, False, _cooldown_note(prof.cooldown_seconds, seconds_since_change)
        )
    try:
        proposal = planner(spec, stats, now_plan)
    except PlanningError as exc:
        return PlanChoice(
            now_plan,
            True,
            ConditionState(
                "False", "SearchFailed", f"Kept {now_plan.describe()}: the re-plan failed: {exc}"
            ),
        )
    best = proposal.plan
    if same_plan(best, now_plan):
        return PlanChoice(best, True, ConditionState("True", "PlanConfirmed", best.reason))
    if best.num_ranks > now_plan.num_ranks:  # the load outgrew the plan: at once
        return PlanChoice(best, True, ConditionState("True", "ScaledUp", best.reason))
    if best.num_ranks < now_plan.num_ranks:
        window_s = spec.capacity.scale_down_stabilization_seconds
        if seconds_since_change < window_s:
            wait_s = window_s - seconds_since_change
            return PlanChoice(
                now_plan,
                True,
                ConditionState(
                    "True",
                    "ScaleDownPending",
                    f"{best.describe()} would do; kept {now_plan.describe()} until the "
                    f"scale-down stabilisation window ends ({int(wait_s)} s left)",
                ),
            )
        return PlanChoice(best, True, ConditionState("True", "ScaledDown", best.reason))
    if cooling:
        return PlanChoice(
            now_plan, True, _cooldown_note(prof.cooldown_seconds, seconds_since_change)
        )
    gain = _gain_note(best, proposal.current_goodput_rps, now_plan, prof.switch_margin_percent)
    if gain is not None:
        return PlanChoice(now_plan, True, ConditionState("True", "KeptCurrentPlan", gain))
    return PlanChoice(best, True, ConditionState("True", "Replanned", best.reason))


def _cooldown_note(cooldown_s: float, seconds_since_change: float) -> ConditionState:
    left_s = int(cooldown_s - seconds_since_change)
    return ConditionState(
        "True", "Cooldown", f"Re-plan due; the plan changed recently ({left_s} s left)"
    )


def _gain_note(
    best: Plan, current_rps: float | None, current: Plan, margin_percent: int
) -> str | None:
    """Why ``best`` does not beat ``current`` by the margin; None when it does (or when no
    goodput of both is known, e.g. heuristic plans, whose choice is deterministic)."""
    if best.predicted is None or current_rps is None:
        return None
    need = current_rps * (1 + margin_percent / 100)
    got = best.predicted.goodput_rps
    if got > need:
        return None
    return (
        f"Best plan {best.describe()} predicts {got:.3g} rps goodput; the current "
        f"{current.describe()} re-simulated on the same window {current_rps:.3g} rps: not "
        f"{margin_percent}% better, kept"
    )


def same_plan(a: Plan, b: Plan) -> bool:
    return (
        a.method == b.method
        and dict(a.pools) == dict(b.pools)
        and a.budgets == b.budgets
        and a.tensor_parallel == b.tensor_parallel
    )
