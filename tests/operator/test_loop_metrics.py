"""What the reconcile loop shows (issue 32 item 5): instances per role, GPUs against the
capacity range, the last decision's rates and a count of decisions (``LoopMetrics``), and an
Event per decision (``decision_report``); then a real ``LocalReconciler`` pass records both."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from epd_engine.config import Role
from epd_operator.api.conditions import ConditionState
from epd_operator.api.decision_status import PlanDecision
from epd_operator.api.spec import EPDDeploymentSpec, PoolStatus
from epd_operator.local import reconciler as local_reconciler
from epd_operator.local.pools import LocalEngines
from epd_operator.local.reconciler import LocalReconciler
from epd_operator.planning.choice import fixed_plan
from epd_operator.planning.plan_pass import PlanMemory, PlanPassResult
from epd_operator.rollout.decision_report import pass_decision, post_decision
from epd_operator.rollout.driver import RolloutOutcome
from epd_operator.rollout.loop_metrics import LoopMetrics, LoopTarget
from epd_operator.rollout.state_machine import Decision
from tests.operator.conftest import make_spec_dict

WHO = LoopTarget("ns", "llava", "tiny-llava")
Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def scrape(metrics: LoopMetrics, who: LoopTarget = WHO) -> Samples:
    """Sample name -> (labels other than namespace/name/model) -> value."""
    out: Samples = {}
    text = generate_latest(metrics.registry).decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert (s.labels["namespace"], s.labels["name"], s.labels["model"]) == who.labels
            rest = tuple(sorted((k, v) for k, v in s.labels.items() if k not in who.__dict__))
            out.setdefault(s.name, {})[rest] = s.value
    return out


def spec(**capacity: int) -> EPDDeploymentSpec:
    return EPDDeploymentSpec.model_validate(
        make_spec_dict(disaggregation={"mode": "Auto"}, gpuBudget=8, capacity=capacity)
    )


def pool(name: str, role: Role, ready: int, gpus: int) -> PoolStatus:
    return PoolStatus(name=name, role=role, desired=ready, ready=ready, gpus=gpus, state="Active")


def decision(outcome: str, target: str = "12.00") -> PlanDecision:
    return PlanDecision(
        time="2026-01-01T00:00:00Z",
        outcome=outcome,
        rate_seen_rps="8.00",
        forecast_rps="10.00",
        target_rps=target,
        plan="E+P+D 1E2P1D",
        predicted_goodput_rps="13.00",
        instances=4,
        gpus=4,
    )


def test_a_pass_exports_instances_gpus_range_rates_and_the_decision() -> None:
    m = LoopMetrics(CollectorRegistry())
    # a switch in flight: two P pools (old and new) both count
    pools = [pool("e", Role.E, 1, 1), pool("p1", Role.P, 1, 1), pool("p2", Role.P, 2, 2),
             pool("d", Role.D, 1, 1)]  # fmt: skip
    m.record_pass(WHO, spec(minGPUs=2, maxGPUs=6), pools, decision("ScaledUp"), decided=True)
    got = scrape(m)
    assert got["epd_loop_instances"] == {
        (("role", "E"),): 1.0,
        (("role", "P"),): 3.0,
        (("role", "D"),): 1.0,
    }
    assert got["epd_loop_gpus"] == {(): 5.0}
    assert got["epd_loop_gpus_bound"] == {(("bound", "min"),): 2.0, (("bound", "max"),): 6.0}
    assert got["epd_loop_rate_observed_rps"] == {(): 8.0}
    assert got["epd_loop_rate_forecast_rps"] == {(): 10.0}
    assert got["epd_loop_rate_target_rps"] == {(): 12.0}
    assert got["epd_loop_decisions_total"] == {(("reason", "ScaledUp"),): 1.0}

    # the next pass: the method changed (E gone, EP came), no new decision, a fixed size
    pools = [pool("ep", Role.EP, 2, 2), pool("d", Role.D, 1, 1)]
    m.record_pass(WHO, spec(), pools, decision("ScaledUp", target=""), decided=False)
    got = scrape(m)
    assert got["epd_loop_instances"] == {
        (("role", "E"),): 0.0, (("role", "P"),): 0.0, (("role", "D"),): 1.0,
        (("role", "EP"),): 2.0,
    }  # fmt: skip
    # capacity unset: maxGPUs is gpuBudget, minGPUs is maxGPUs
    assert got["epd_loop_gpus_bound"] == {(("bound", "min"),): 8.0, (("bound", "max"),): 8.0}
    assert "epd_loop_rate_target_rps" not in got  # no target once the size is fixed
    assert got["epd_loop_decisions_total"] == {(("reason", "ScaledUp"),): 1.0}  # counted once


def test_fixed_mode_exports_no_rate_and_no_decision() -> None:
    m = LoopMetrics(CollectorRegistry())
    m.record_pass(WHO, spec(), [pool("epd", Role.EPD, 1, 0)], None, decided=False)
    got = scrape(m)
    assert set(got) == {"epd_loop_instances", "epd_loop_gpus", "epd_loop_gpus_bound"}
    assert got["epd_loop_gpus"] == {(): 0.0}  # a CPU engine holds no GPU


def _passed(note: str | None, ran: bool) -> PlanPassResult:
    plan = fixed_plan(EPDDeploymentSpec.model_validate(make_spec_dict()))
    state = None if note is None else ConditionState("True", note, "why")
    memory = PlanMemory(decision=decision(note or "Planned"))
    return PlanPassResult(plan, memory, state, 0.5 if ran else None)


@pytest.mark.parametrize(
    ("note", "ran", "made"),
    [
        ("ScaledUp", True, True),  # the re-plan ran
        ("FastScaledUp", False, True),  # news without a re-plan: the fast path
        ("Cooldown", True, True),  # an elastic re-plan that ran, held back by the cooldown
        ("Cooldown", False, False),  # repeated every pass until the cooldown ends
        (None, False, False),  # nothing due
    ],
)
def test_a_decision_is_a_re_plan_that_ran_or_news(note: str | None, ran: bool, made: bool) -> None:
    passed = _passed(note, ran)
    assert (pass_decision(passed) is passed.memory.decision) is made
    assert (pass_decision(passed) is None) is not made


def test_each_decision_is_an_event_saying_why() -> None:
    events: list[tuple[str, str, str]] = []
    post_decision(lambda *e: events.append(e), decision("ScaledUp"))
    post_decision(lambda *e: events.append(e), decision("SearchFailed"))
    (kind, reason, message), failed = events
    assert (kind, reason) == ("Normal", "ScaledUp")
    assert "rate seen 8.00 rps" in message and "target 12.00 rps" in message
    assert message.endswith("-> E+P+D 1E2P1D, predicted goodput 13.00 rps, 4 GPUs")
    assert failed[:2] == ("Warning", "SearchFailed")


class NoTrace:
    def trace_window(self, window_s: float, in_flight: bool = False) -> None:
        return None


def test_a_local_pass_posts_the_first_plan_and_records_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``epdctl up``'s loop, Auto, no trace yet: the first plan is a decision (an event) and
    the pass is in the metrics; the rollout is stubbed with the pools it would observe."""
    observed = [pool("e", Role.E, 1, 1), pool("p", Role.P, 1, 1), pool("d", Role.D, 0, 1)]

    def rollout(backend: Any, fleet: Any, desired: Any, plan: Any, state: Any, *_: Any) -> Any:
        progressing = ConditionState("True", "WaitingForPools", "starting")
        return RolloutOutcome(Decision(conditions={"Progressing": progressing},
                                       pools=observed), state, False)  # fmt: skip

    monkeypatch.setattr(local_reconciler, "rollout_pass", rollout)
    engines = LocalEngines(tmp_path, "tiny-llava", "http://127.0.0.1:9", tmp_path, "token")
    events: list[tuple[str, str, str]] = []
    metrics = LoopMetrics(CollectorRegistry())
    loop = LocalReconciler("llava", engines, lambda *e: events.append(e), metrics=metrics)
    loop.router = NoTrace()  # type: ignore[assignment]
    now = datetime(2026, 1, 1, tzinfo=UTC)
    loop.reconcile(spec(), now)
    loop.reconcile(spec(), now)  # nothing due: no second decision
    planned = [e for e in events if e[1] == "Planned"]
    assert len(planned) == 1 and planned[0][0] == "Normal"
    assert planned[0][2].startswith("Planned at 2026-01-01T00:00:00Z: rate seen ? rps")
    got = scrape(metrics, LoopTarget("local", "llava", "tiny-llava"))
    assert got["epd_loop_decisions_total"] == {(("reason", "Planned"),): 1.0}
    assert got["epd_loop_instances"] == {
        (("role", "E"),): 1.0,
        (("role", "P"),): 1.0,
        (("role", "D"),): 0.0,
    }
