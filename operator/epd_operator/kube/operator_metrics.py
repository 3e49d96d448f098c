"""The operator's own Prometheus metrics: reconcile passes, plan decisions with their reason,
plan-search time and each EPDDeployment's rollout phase; and the loop's (``LOOP``, as
``epdctl up`` exports them: instances per role, GPUs, rates, decisions).

Served on ``EPD_OPERATOR_METRICS_PORT`` (0: not served) by ``handlers.py`` at start-up, from
their own registry (no process/platform collectors mixed in)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from epd_operator.rollout.loop_metrics import LoopMetrics

REGISTRY = CollectorRegistry()
LOOP = LoopMetrics(REGISTRY)

RECONCILES = Counter(
    "epd_operator_reconciles",
    "Reconcile passes, by outcome (ok, invalid_spec, api_error)",
    ["namespace", "name", "outcome"],
    registry=REGISTRY,
)
DECISIONS = Counter(
    "epd_operator_plan_decisions",
    "Auto-mode plan decisions, by the Planned condition's reason (Planned, PlanConfirmed, "
    "Replanned, KeptCurrentPlan, Cooldown, SearchFailed)",
    ["namespace", "name", "reason"],
    registry=REGISTRY,
)
PLANNER_SECONDS = Histogram(
    "epd_operator_planner_seconds",
    "Time to make a plan (trace read excluded): the bounded search or the heuristic",
    ["namespace", "name"],
    buckets=(0.01, 0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120),
    registry=REGISTRY,
)
ROLLOUT_PHASE = Gauge(
    "epd_operator_rollout_phase",
    "1 for the Progressing reason an EPDDeployment is in (RolloutComplete, WaitingForPools, "
    "SwitchingRouting, Draining, SteppedRollout, BudgetBlocksRollout, RouterUnreachable, ...)",
    ["namespace", "name", "phase"],
    registry=REGISTRY,
)
_phases: dict[tuple[str, str], str] = {}


def set_phase(namespace: str, name: str, phase: str) -> None:
    """One series per EPDDeployment at 1: the previous phase's series is removed."""
    previous = _phases.get((namespace, name))
    if previous is not None and previous != phase:
        ROLLOUT_PHASE.remove(namespace, name, previous)
    ROLLOUT_PHASE.labels(namespace, name, phase).set(1)
    _phases[(namespace, name)] = phase


def serve(port: int) -> None:
    if port:
        start_http_server(port, registry=REGISTRY)
