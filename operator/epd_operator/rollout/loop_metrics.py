"""What the reconcile loop shows on a dashboard, the same for both backends: instances per
role, the GPUs the pools hold against the capacity range, the rates of the last decision
(seen, forecast, target) and a count of decisions by outcome.

The operator registers them in its own registry (``kube/operator_metrics.py``: one set of
series per EPDDeployment); ``epdctl up`` in one it serves on loopback (``metrics_url`` in
the state file). Labels: ``namespace``, ``name`` (the EPDDeployment) and ``model`` (what
clients ask for: the engines' ``model`` label). The rates and the decisions exist once an
Auto re-plan decided (none in Fixed mode).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import suppress
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from epd_operator.api.decision_status import PlanDecision
from epd_operator.api.spec import EPDDeploymentSpec, PoolStatus

_BASE = ("namespace", "name", "model")


@dataclass(frozen=True)
class LoopTarget:
    """Whose loop: the series' labels."""

    namespace: str
    name: str
    model: str

    @property
    def labels(self) -> tuple[str, str, str]:
        return self.namespace, self.name, self.model


def gpu_range(spec: EPDDeploymentSpec) -> tuple[int, int]:
    """``capacity.minGPUs`` and ``maxGPUs`` as the loop reads them (max unset: gpuBudget;
    min unset: max, a fixed size)."""
    most = spec.capacity.max_gpus if spec.capacity.max_gpus is not None else spec.gpu_budget
    least = spec.capacity.min_gpus if spec.capacity.min_gpus is not None else most
    return least, most


def _rps(text: str) -> float | None:
    return float(text) if text else None


class LoopMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        r = registry
        self.instances = Gauge(
            "epd_loop_instances",
            "Ready instances per role over every pool (a switch's old and new pools both).",
            (*_BASE, "role"),
            registry=r,
        )
        self.gpus = Gauge("epd_loop_gpus", "GPUs the pools hold.", _BASE, registry=r)
        self.gpus_bound = Gauge(
            "epd_loop_gpus_bound",
            "The capacity range: bound=min (capacity.minGPUs) and max (capacity.maxGPUs).",
            (*_BASE, "bound"),
            registry=r,
        )
        self.rate_observed = Gauge(
            "epd_loop_rate_observed_rps",
            "The trace window's mean request rate at the last re-plan.",
            _BASE,
            registry=r,
        )
        self.rate_forecast = Gauge(
            "epd_loop_rate_forecast_rps",
            "The rate the last re-plan expected once its plan serves.",
            _BASE,
            registry=r,
        )
        self.rate_target = Gauge(
            "epd_loop_rate_target_rps",
            "The rate the last re-plan sized for: forecast x headroom (elastic capacity).",
            _BASE,
            registry=r,
        )
        self.decisions = Counter(
            "epd_loop_decisions",
            "Re-plans, by their outcome (the Planned reason: Planned, ScaledUp, "
            "ScaleDownPending, ScaledDown, PlanConfirmed, Replanned, KeptCurrentPlan, ...).",
            (*_BASE, "reason"),
            registry=r,
        )
        self._roles: dict[LoopTarget, set[str]] = {}

    def record_pass(
        self,
        who: LoopTarget,
        spec: EPDDeploymentSpec,
        pools: Iterable[PoolStatus],
        decision: PlanDecision | None,
        decided: bool,
    ) -> None:
        """One pass: the pools as observed after acting, the status's last decision, and
        whether this pass made it (``decision_report.pass_decision``)."""
        ready: dict[str, int] = {}
        gpus = 0
        for pool in pools:
            ready[pool.role.value] = ready.get(pool.role.value, 0) + pool.ready
            gpus += pool.gpus
        roles = self._roles.setdefault(who, set())
        roles.update(ready)
        for role in roles:  # a role whose pools are gone reads 0, not its last count
            self.instances.labels(*who.labels, role).set(ready.get(role, 0))
        self.gpus.labels(*who.labels).set(gpus)
        least, most = gpu_range(spec)
        self.gpus_bound.labels(*who.labels, "min").set(least)
        self.gpus_bound.labels(*who.labels, "max").set(most)
        if decision is None:
            return
        for gauge, text in (
            (self.rate_observed, decision.rate_seen_rps),
            (self.rate_forecast, decision.forecast_rps),
            (self.rate_target, decision.target_rps),
        ):
            value = _rps(text)
            if value is not None:
                gauge.labels(*who.labels).set(value)
            else:  # e.g. no target once the size is fixed again
                with suppress(KeyError):
                    gauge.remove(*who.labels)
        if decided:
            self.decisions.labels(*who.labels, decision.outcome).inc()
