"""One reconcile pass: read actual state, decide (loop.py), write children, return the status.

Framework-free so it can be driven by the kopf timer (handlers.py) or a test. Every pass
re-reads the cluster; nothing is remembered between passes except what is in ``status``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from epd_engine.contracts.plan import Plan
from epd_engine.contracts.trace import TraceRecord
from epd_engine.profiler.cost_model import FittedCostModel
from epd_operator.api.conditions import ConditionState
from epd_operator.api.spec import (
    Condition,
    EPDDeploymentSpec,
    EPDDeploymentStatus,
)
from epd_operator.kube import guardrails, pod_health
from epd_operator.kube import manifests as r
from epd_operator.kube import operator_metrics as metrics
from epd_operator.kube.client import Kube
from epd_operator.planning.alarm import SloAlarm
from epd_operator.planning.background_search import BackgroundSearch
from epd_operator.planning.choice import WorkloadStats
from epd_operator.planning.daily_profile import profile_ratio
from epd_operator.planning.offered import offered
from epd_operator.planning.plan_pass import (
    ALARM_WINDOW_S,
    PlanMemory,
    Searched,
    measure_switch,
    plan_pass,
)
from epd_operator.planning.planner import (
    MAX_PLAN_REQUESTS,
    PLAN_TIMEOUT_S,
    cost_model_from_json,
    reference_cost,
    workload_stats,
)
from epd_operator.planning.prometheus import Prometheus, with_live_attainment
from epd_operator.rollout.alarm_reader import AlarmReader
from epd_operator.rollout.decision_report import pass_decision, post_decision
from epd_operator.rollout.driver import Checkpoint, RolloutState, no_checkpoint, rollout_pass
from epd_operator.rollout.loop_metrics import LoopTarget
from epd_operator.rollout.pool_identity import PoolSpec
from epd_operator.rollout.router_api import RouterAPI
from epd_operator.rollout.router_fleet import RouterFleet
from epd_operator.rollout.state_machine import ObservedPool

PostEvent = Callable[[str, str, str], None]  # (type, reason, message)


class KubePools:
    """The rollout's pools as Deployments (and their Services) of one EPDDeployment."""

    def __init__(self, kube: Kube, owner: r.Owner, plan: Plan) -> None:
        self.kube, self.owner, self.plan = kube, owner, plan

    def observe_pools(self) -> dict[str, ObservedPool]:
        o = self.owner
        return self.kube.observe_pools(o.namespace, o.name, o.spec.gpu_resource_name)

    def apply_pool(self, pool: PoolSpec) -> None:
        self.kube.apply(r.render_pool_deployment(self.owner, pool, self.plan))
        self.kube.apply(r.render_pool_service(self.owner, pool))

    def delete_pool(self, name: str) -> None:
        self.kube.delete_pool(self.owner.namespace, name)


# Per EPDDeployment (uid): the fast path's previous queue reading, kept in this process (a
# restarted operator sees a growing queue one pass later).
_ALARMS: dict[str, AlarmReader] = {}
# Per EPDDeployment (uid): its re-plan, run beside the passes (background_search.py); a
# restarted operator starts a fresh one at its first due pass.
_SEARCHES: dict[str, BackgroundSearch[Searched]] = {}


def replan_finished(uid: str) -> bool:
    """A background re-plan of this EPDDeployment ended: the next tick's pass takes it."""
    search = _SEARCHES.get(uid)
    return search is not None and search.finished


def forget(uid: str) -> None:
    """A deleted EPDDeployment's per-process state (a search still running finishes unread)."""
    _ALARMS.pop(uid, None)
    _SEARCHES.pop(uid, None)


def _ts(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_ts(text: str) -> datetime | None:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC) if text else None


def _status(raw: dict[str, Any] | None) -> EPDDeploymentStatus:
    try:
        return EPDDeploymentStatus.model_validate(raw or {})
    except ValidationError:
        return EPDDeploymentStatus()


def merge_conditions(
    old: list[Condition], new: dict[str, tuple[str, str, str]], generation: int, now: datetime
) -> list[Condition]:
    """Conditions in fixed order (then any other type given, e.g. ``Planned``);
    lastTransitionTime moves only when the status flips."""
    before: dict[str, Condition] = {c.type: c for c in old}
    out = []
    fixed = ("Ready", "Progressing", "Degraded")
    for ctype in (*fixed, *(t for t in new if t not in fixed)):
        status, reason, message = new[ctype]
        prev = before.get(ctype)
        since = prev.last_transition_time if prev and prev.status == status else _ts(now)
        out.append(
            Condition.model_validate(
                {
                    "type": ctype,
                    "status": status,
                    "reason": reason,
                    "message": message,
                    "lastTransitionTime": since,
                    "observedGeneration": generation,
                }
            )
        )
    return out


PLANNED = "Planned"  # Auto mode: how the last re-plan went (kept until the next one)


def _planned_condition(
    spec: EPDDeploymentSpec, old: list[Condition], note: ConditionState | None
) -> tuple[str, str, str] | None:
    if spec.disaggregation.mode == "Fixed":
        return None
    if note is not None:
        return (note.status, note.reason, note.message)
    prev = next((c for c in old if c.type == PLANNED), None)
    return (prev.status, prev.reason, prev.message) if prev else None


def invalid_spec_status(
    raw_status: dict[str, Any] | None, message: str, generation: int
) -> dict[str, Any]:
    status = _status(raw_status)
    conditions = merge_conditions(
        status.conditions,
        {
            "Ready": ("False", "InvalidSpec", "The spec is invalid; nothing was changed"),
            "Progressing": ("False", "InvalidSpec", "Fix the spec to continue"),
            "Degraded": ("True", "InvalidSpec", message),
        },
        generation,
        datetime.now(UTC),
    )
    new = status.model_copy(update={"conditions": conditions, "observed_generation": generation})
    return new.model_dump(mode="json", by_alias=True)


def _cost_model(kube: Kube, namespace: str, spec: EPDDeploymentSpec) -> tuple[FittedCostModel, str]:
    """``spec.profiler.costModel`` from its ConfigMap, or the built-in reference."""
    ref = spec.profiler.cost_model
    if ref is None:
        return reference_cost()
    where = f"ConfigMap {ref.config_map_name} key {ref.key}"
    text = kube.read_config_map_key(namespace, ref.config_map_name, ref.key)
    return cost_model_from_json(text, where), where


def reconcile(
    kube: Kube,
    name: str,
    namespace: str,
    uid: str,
    generation: int,
    raw_spec: dict[str, Any],
    raw_status: dict[str, Any] | None,
    post_event: PostEvent,
    router_timeout_s: float = 2.0,
    plan_timeout_s: float = PLAN_TIMEOUT_S,
    plan_max_requests: int = MAX_PLAN_REQUESTS,
    router_urls: Sequence[str] = (),
    checkpoint: Checkpoint = no_checkpoint,
) -> dict[str, Any]:
    """Converge the children of one EPDDeployment; returns the new ``status`` (camelCase)."""
    now = datetime.now(UTC)
    try:
        spec = EPDDeploymentSpec.model_validate(raw_spec)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = "spec." + ".".join(str(p) for p in first["loc"])
        metrics.RECONCILES.labels(namespace, name, "invalid_spec").inc()
        return invalid_spec_status(raw_status, f"{where}: {first['msg']}", generation)
    status = _status(raw_status)
    owner = r.Owner(name=name, namespace=namespace, uid=uid, spec=spec)

    token = kube.ensure_secret(lambda t: r.render_secret(owner, t), namespace, r.secret_name(owner))
    # the trace through the Service (any replica), or the first given address
    router = RouterAPI(
        router_urls[0] if router_urls else r.router_url(owner), token, router_timeout_s
    )

    # which plan (the same decision as local mode's)
    def read_workload() -> tuple[Sequence[TraceRecord] | None, WorkloadStats | None]:
        stats: WorkloadStats | None = None
        trace = router.trace_window(spec.profiler.trace_window_seconds, in_flight=True)
        records = offered(trace.records) if trace is not None else None
        if trace is not None and records is not None:
            stats = workload_stats(records, trace.span_s, spec.slo.to_slo())
        if spec.monitoring.prometheus_url:
            prom = Prometheus(spec.monitoring.prometheus_url)
            live = prom.workload(spec.model.name, namespace, spec.profiler.trace_window_seconds)
            stats = with_live_attainment(stats, live)
        return records, stats

    current_pools = (
        {p.name for p in r.deployment_pools(owner, status.plan.to_plan())} if status.plan else None
    )

    def read_alarms() -> Sequence[SloAlarm]:
        # the fast path's scrape window: the last resync's requests (one replica's trace)
        reader = _ALARMS.setdefault(uid, AlarmReader(ALARM_WINDOW_S))
        return reader.read(router, spec, current_pools or ())

    read_profile = None
    if spec.monitoring.prometheus_url:  # a day of history there: the daily profile
        prom_url, window_s = spec.monitoring.prometheus_url, spec.profiler.trace_window_seconds

        def read_profile(horizon_s: float) -> float | None:
            return profile_ratio(
                Prometheus(prom_url), spec.model.name, namespace, window_s, horizon_s
            )

    last_switch_ms = status.last_switch_milliseconds
    memory = PlanMemory(
        status.plan,
        _parse_ts(status.last_planned),
        _parse_ts(status.last_plan_change),
        status.planned_on,
        None if last_switch_ms is None else last_switch_ms / 1000,
        status.decision,
    )
    passed = plan_pass(
        spec,
        memory,
        now,
        read_workload,
        post_event,
        lambda: _cost_model(kube, namespace, spec),
        plan_timeout_s,
        plan_max_requests,
        read_alarms=read_alarms,
        serving=set(status.active_pools) == current_pools,
        search=_SEARCHES.setdefault(uid, BackgroundSearch()),
        read_profile=read_profile,
    )
    if passed.planner_s is not None:
        metrics.PLANNER_SECONDS.labels(namespace, name).observe(passed.planner_s)
    if passed.note is not None:
        metrics.DECISIONS.labels(namespace, name, passed.note.reason).inc()
    made = pass_decision(passed)  # this pass's decision, as an Event
    if made is not None:
        post_decision(post_event, made)
    plan, memory = passed.plan, passed.memory
    assert memory.plan is not None

    # shared children, then the rollout (the same driver as the local backend)
    desired = r.deployment_pools(owner, plan)
    addresses = list(router_urls) or kube.router_addresses(namespace, name, spec.router.port)
    state = RolloutState(frozenset(status.active_pools), _parse_ts(status.draining_since))
    outcome = rollout_pass(
        KubePools(kube, owner, plan),
        RouterFleet(addresses, token, router_timeout_s),
        desired,
        plan,
        state,
        now,
        spec.gpu_budget,
        spec.rollout.drain_timeout_seconds,
        post_event,
        router_ready=kube.router_ready(namespace, r.router_name(owner)),
        checkpoint=checkpoint,
    )
    decision = outcome.status
    memory = measure_switch(
        memory, outcome.switched, outcome.state.active_pools, (d.name for d in desired), now
    )
    # The router reads this at start: the routing every replica confirmed (None: all pools).
    kube.apply(r.render_configmap(owner, plan, sorted(outcome.state.active_pools)))
    kube.apply(r.render_router_deployment(owner))
    kube.apply(r.render_router_service(owner))
    kube.apply(r.render_router_pods_service(owner))
    guardrails.converge(kube, owner)  # network policies, disruption budgets

    ready = sum(
        1 for p in decision.pools if p.name in {d.name for d in desired} and p.ready >= p.desired
    )
    decided = {k: (c.status, c.reason, c.message) for k, c in decision.conditions.items()}
    decided = pod_health.report(kube, owner, decided, status.conditions, post_event)
    planned = _planned_condition(spec, status.conditions, passed.note)
    if planned is not None:
        decided[PLANNED] = planned
    conditions = merge_conditions(status.conditions, decided, generation, now)
    metrics.set_phase(namespace, name, decision.conditions["Progressing"].reason)
    who = LoopTarget(namespace, name, spec.model.name)
    metrics.LOOP.record_pass(who, spec, decision.pools, memory.decision, made is not None)
    metrics.RECONCILES.labels(namespace, name, "ok").inc()
    new = EPDDeploymentStatus(
        observed_generation=generation,
        conditions=conditions,
        plan=memory.plan,
        pools=decision.pools,
        active_pools=sorted(outcome.state.active_pools),
        ready_pools=f"{ready}/{len(desired)}",
        draining_since=_ts(outcome.state.draining_since) if outcome.state.draining_since else "",
        last_planned=_ts(memory.last_planned) if memory.last_planned else "",
        last_plan_change=_ts(memory.last_change) if memory.last_change else "",
        planned_on=memory.planned_on,
        decision=memory.decision,
        last_switch_milliseconds=None
        if memory.last_switch_s is None
        else round(memory.last_switch_s * 1000),
    )
    return new.model_dump(mode="json", by_alias=True)
