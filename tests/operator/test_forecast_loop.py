"""The local reconcile loop sizes an elastic plan for the forecast rate, not the window's mean,
and its status says why (issue 32 item 4). Real passes of ``LocalReconciler`` (plan_pass, the
bounded profiler in its child process, the reference cost model) with the rollout stubbed, as
in ``test_local_cost_model``; on textvqa the best 1 / 2 instances serve 13.9 / 29.0 rps."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from epd_engine.contracts.trace import TraceRecord
from epd_engine.profiler.reference import reference_cost_model
from epd_engine.workload.arrivals import ArrivalSpec
from epd_engine.workload.generators import synthesize
from epd_operator.api.conditions import ConditionState
from epd_operator.api.spec import EPDDeploymentSpec, EPDDeploymentStatus
from epd_operator.local import reconciler as local_reconciler
from epd_operator.local.pools import LocalEngines
from epd_operator.local.reconciler import LocalReconciler
from epd_operator.planning.decision import describe_decision
from epd_operator.planning.plan_pass import PlanMemory
from epd_operator.planning.planner import profiler_proposal
from epd_operator.rollout.driver import RolloutOutcome, RolloutState
from epd_operator.rollout.router_api import TraceWindow
from epd_operator.rollout.state_machine import Decision
from tests.operator.conftest import make_spec_dict

SPAN_S = 60.0
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def ramp(low_rps: float, high_rps: float, seed: int = 0) -> list[TraceRecord]:
    """textvqa requests arriving at a rate rising linearly from ``low_rps`` to ``high_rps``
    over ``SPAN_S`` (Poisson, by thinning)."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    while (t := t + rng.expovariate(high_rps)) < SPAN_S:
        if rng.random() < (low_rps + (high_rps - low_rps) * t / SPAN_S) / high_rps:
            arrivals.append(t)
    records = synthesize("textvqa", len(arrivals), ArrivalSpec("poisson", 5.0), seed=seed)
    return [r.model_copy(update={"arrival_s": a}) for r, a in zip(records, arrivals, strict=True)]


class FakeRouter:
    def __init__(self, records: list[TraceRecord]) -> None:
        self.records = records

    def trace_window(self, window_s: float, in_flight: bool = False) -> TraceWindow:
        return TraceWindow(self.records, SPAN_S)

    def waiting(self) -> dict[str, tuple[str, int, int]]:  # the fast path's queues: none
        return {}


class StubRollout:
    """The rollout, stubbed: every pool of the plan is switched to at once when ``switch``."""

    def __init__(self) -> None:
        self.switch = False

    def __call__(
        self, backend: Any, fleet: Any, desired: Any, plan: Any, state: Any, *_: Any
    ) -> Any:
        progressing = ConditionState("True", "RolloutComplete", "done")
        done = Decision(conditions={"Progressing": progressing})
        if not self.switch:
            return RolloutOutcome(done, state, False)
        return RolloutOutcome(done, RolloutState(frozenset(p.name for p in desired)), True)


def elastic_spec() -> EPDDeploymentSpec:
    return EPDDeploymentSpec.model_validate(
        make_spec_dict(
            disaggregation={"mode": "Auto"},
            capacity={"minGPUs": 1, "maxGPUs": 8, "headroomPercent": 20},
            profiler={"minRequests": 100},
        )
    )


def test_a_rising_rate_is_sized_for_its_forecast_and_the_status_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rollout = StubRollout()
    monkeypatch.setattr(local_reconciler, "rollout_pass", rollout)
    engines = LocalEngines(tmp_path, "tiny-llava", "http://127.0.0.1:9", tmp_path, "token")
    loop = LocalReconciler("demo", engines, lambda *e: None)
    loop.memory = PlanMemory(last_switch_s=10.0)  # a switch measured earlier took 10 s
    records = ramp(6.0, 14.0)  # mean 10 rps; 14 now, rising 8 rps a minute
    loop.router = FakeRouter(records)  # type: ignore[assignment]
    spec = elastic_spec()

    status = loop.reconcile(spec, T0)
    why = status.to_json()["decision"]
    seen, forecast = float(why["rateSeenRps"]), float(why["forecastRps"])
    assert seen == pytest.approx(10.0, rel=0.05)
    assert why["horizonSeconds"] == 10 and why["horizonSource"] == "last switch"
    # the rate at the window's end plus the trend over the 10 s horizon
    assert forecast == pytest.approx(14.0 + 8.0 / SPAN_S * 10.0, rel=0.1)
    assert float(why["trendRpsPerMinute"]) == pytest.approx(8.0, rel=0.25)
    assert float(why["targetRps"]) == pytest.approx(forecast * 1.2, abs=0.01)
    # sized for the forecast: the fewest instances covering it, more than the mean needed
    cost = reference_cost_model()
    for_mean = profiler_proposal(spec, records, cost, target_rps=seen * 1.2).plan
    assert status.plan == why["plan"] and why["instances"] == 2 > for_mean.num_instances
    assert float(why["predictedGoodputRps"]) >= float(why["targetRps"])
    assert why["gpus"] == 2 and why["outcome"] == "Planned"
    assert "2 instances for" in status.reason and "forecast x headroom" in status.reason

    # the operator's status carries the same record (camelCase, as the CRD has it)
    assert loop.memory.decision is not None
    kube = EPDDeploymentStatus(decision=loop.memory.decision).model_dump(mode="json", by_alias=True)
    assert kube["decision"] == why
    line = describe_decision(loop.memory.decision)  # what `epdctl status` prints
    assert f"forecast {why['forecastRps']} rps 10 s ahead" in line
    assert line.endswith(
        f"-> {status.plan}, predicted goodput {why['predictedGoodputRps']} rps, 2 GPUs"
    )

    # the switch completes 40 s later: the next forecast looks that far ahead
    rollout.switch = True
    loop.reconcile(spec, T0 + timedelta(seconds=40))
    assert loop.memory.last_switch_s == 40.0

    # the rate goes on rising: the next re-plan looks 40 s ahead and scales up for it
    loop.router = FakeRouter(ramp(12.0, 24.0, seed=1))  # type: ignore[assignment]
    rollout.switch = False
    loop.reconcile(spec, T0 + timedelta(seconds=400))  # starts the re-plan beside the passes
    assert loop.search.wait(120)
    status = loop.reconcile(spec, T0 + timedelta(seconds=401))  # and takes its choice
    why = status.to_json()["decision"]
    assert why["horizonSeconds"] == 40 and why["horizonSource"] == "last switch"
    assert float(why["forecastRps"]) == pytest.approx(24.0 + 12.0 / SPAN_S * 45.0, rel=0.1)
    assert why["outcome"] == "ScaledUp" and why["instances"] == 3  # 2 serve 29.0 rps
