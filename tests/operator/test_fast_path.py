"""The fast path (issue 32 item 3): SLO alarms over the last scrape window -> one more
instance for the bottleneck stage, within maxGPUs, never fewer; and through ``plan_pass``,
recorded in the status with the alarm, the stage and the sizes before and after."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import pytest

from epd_engine.config import SLO, Method, Role, Stage
from epd_engine.contracts.plan import Plan
from epd_engine.contracts.trace import TraceRecord
from epd_operator.api.spec import EPDDeploymentSpec, PlanStatus
from epd_operator.planning.alarm import SloAlarm, queue_alarms, slo_alarms
from epd_operator.planning.decision import describe_decision
from epd_operator.planning.fast_path import fast_step
from epd_operator.planning.plan_pass import PlanMemory, plan_pass
from tests.operator.conftest import make_spec_dict

SLO_ = SLO(ttft_s=1.0, tpot_s=0.05, attainment=0.9)
T0 = datetime(2026, 1, 1, tzinfo=UTC)
EPD3 = Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 1, Role.D: 1}, reason="planned")


def spec(max_gpus: int = 6, mode: str = "Auto") -> EPDDeploymentSpec:
    return EPDDeploymentSpec.model_validate(
        make_spec_dict(
            gpuBudget=8,
            disaggregation={"mode": mode} if mode == "Auto" else make_spec_dict()["disaggregation"],
            capacity={"minGPUs": 1, "maxGPUs": max_gpus},
        )
    )


def finished(n: int, ttft_s: float = 0.2, tpot_s: float = 0.02, span_s: float = 20.0):
    """``n`` requests finished within the last 10 s of a 20 s window."""
    return [
        TraceRecord(
            arrival_s=span_s - 9 + i * 8 / n,
            prompt_tokens=10,
            output_tokens=4,
            ttft_s=ttft_s,
            tpot_s=tpot_s,
            e2e_s=0.5,
        )
        for i in range(n)
    ]


def alarms(records: Sequence[TraceRecord], queues=None) -> list[SloAlarm]:
    return slo_alarms(records, 20.0, SLO_, 10.0, queues or {}, [])


def test_no_alarm_when_attainment_is_met_or_too_few_requests() -> None:
    assert alarms(finished(20)) == []
    assert alarms(finished(5, ttft_s=3.0)) == []  # 5 requests: too few to tell
    # requests that finished before the scrape window do not count
    old = [r.model_copy(update={"arrival_s": 2.0}) for r in finished(20, ttft_s=3.0)]
    assert alarms(old) == []


@pytest.mark.parametrize(
    ("queues", "stage"),
    [
        ({Role.E: 6.0, Role.P: 1.0, Role.D: 0.0}, Stage.ENCODE),  # encode queues
        ({Role.E: 1.0, Role.P: 4.0, Role.D: 0.0}, Stage.PREFILL),
        ({}, Stage.PREFILL),  # no queue known: prefill makes the first token
    ],
)
def test_a_ttft_miss_blames_the_longer_first_token_queue(queues, stage) -> None:
    (alarm,) = alarms(finished(20, ttft_s=3.0), queues)
    assert alarm.kind == "TTFT" and alarm.stage == stage
    assert "TTFT attainment 0% < 90%" in alarm.reason


def test_a_tpot_miss_alarms_decode_and_the_worse_miss_comes_first() -> None:
    (alarm,) = alarms(finished(20, tpot_s=0.2))
    assert (alarm.kind, alarm.stage) == ("TPOT", Stage.DECODE)
    both = finished(10, ttft_s=3.0) + finished(10, ttft_s=3.0, tpot_s=0.2)  # TTFT 0%, TPOT 50%
    assert [a.kind for a in alarms(both)] == ["TTFT", "TPOT"]


def test_queue_growth_alarms_the_pool_whose_backlog_held_and_grew() -> None:
    now = {Role.E: 3.0, Role.P: 5.0, Role.D: 2.5}
    held = {Role.E: 2.0, Role.P: 6.0, Role.D: 2.0}
    assert queue_alarms(now, []) == []  # no earlier reading
    assert queue_alarms(now, [held]) == []  # one earlier reading: too few to tell
    # E and D held at >= 2 and grew; P shrank from 6 to 5
    e, d = queue_alarms(now, [{Role.E: 2.0, Role.P: 6.0, Role.D: 2.0}, held])
    assert (e.kind, e.stage, d.stage) == ("queue", Stage.ENCODE, Stage.DECODE)
    assert "E queue grew from 2.0 to 3.0 waiting requests per instance over the last 3" in e.reason


def test_a_burst_between_two_readings_is_not_a_backlog() -> None:
    """The defect: one reading's jump (0 -> 2 waiting per instance, a Poisson burst at 100 %
    attainment) alarmed, and the elastic bench's fast path added 9 encoders one at a time."""
    assert queue_alarms({Role.ED: 2.0}, [{Role.ED: 0.0}, {Role.ED: 0.0}]) == []
    assert queue_alarms({Role.ED: 3.0}, [{Role.ED: 2.0}, {Role.ED: 0.5}]) == []  # a dip
    assert queue_alarms({Role.ED: 2.0}, [{Role.ED: 2.0}, {Role.ED: 2.0}]) == []  # not growing
    # a role the earlier readings lack (a new pool): no alarm yet
    assert queue_alarms({Role.ED: 4.0}, [{Role.E: 2.0}, {Role.E: 3.0}]) == []


def test_the_ep_pool_queue_steps_ep() -> None:
    # an EP pool's queue: encode is its first stage, and EP is the pool that grows
    (ep,) = queue_alarms({Role.EP: 4.0}, [{Role.EP: 2.0}, {Role.EP: 3.0}])
    plan = Plan(method=Method.EP_D, pools={Role.EP: 1, Role.D: 1})
    step = fast_step(spec(), plan, [ep])
    assert step is not None and step.after.pools == {Role.EP: 2, Role.D: 1}


@pytest.mark.parametrize(
    ("stage", "grown"),
    [(Stage.ENCODE, Role.E), (Stage.PREFILL, Role.P), (Stage.DECODE, Role.D)],
)
def test_the_step_adds_one_instance_to_the_stage_pool(stage: Stage, grown: Role) -> None:
    step = fast_step(spec(), EPD3, [SloAlarm("TTFT", stage, "why")])
    assert step is not None and step.role == grown
    assert step.after.pools == {**EPD3.pools, grown: 2}
    assert step.after.method == EPD3.method and step.after.budgets == EPD3.budgets
    assert step.sizes == f"{grown} 1 -> 2" and step.after.reason.startswith("fast path: why")


def test_no_step_beyond_max_gpus_in_fixed_mode_or_without_alarm() -> None:
    alarm = [SloAlarm("TTFT", Stage.PREFILL, "why")]
    assert fast_step(spec(max_gpus=3), EPD3, alarm) is None  # 3 instances hold maxGPUs
    assert fast_step(spec(max_gpus=4), EPD3, alarm) is not None
    assert fast_step(spec(mode="Fixed"), EPD3, alarm) is None
    assert fast_step(spec(), EPD3, []) is None


def _pass(memory: PlanMemory, now: datetime, found: list[SloAlarm], serving: bool = True):
    reads: list[int] = []

    def read_alarms() -> list[SloAlarm]:
        reads.append(1)
        return found

    def no_workload():
        raise AssertionError("the slow path is not due")

    passed = plan_pass(
        spec(), memory, now, no_workload, lambda *e: None, read_alarms=read_alarms,
        serving=serving, alarm_window_s=10.0,
    )  # fmt: skip
    return passed, len(reads)


def test_plan_pass_scales_up_records_why_and_keeps_the_slow_paths_schedule() -> None:
    memory = PlanMemory(
        plan=PlanStatus.from_plan(EPD3, 3), last_planned=T0, last_change=T0, last_switch_s=5.0
    )
    alarm = SloAlarm("TTFT", Stage.ENCODE, "TTFT attainment 40% < 90%")
    # within a scrape window after the last switch served: the alarm may be about the old plan
    passed, reads = _pass(memory, T0 + timedelta(seconds=14), [alarm])
    assert (passed.plan, reads) == (EPD3, 0)
    # while a rollout is in progress: wait for it
    passed, reads = _pass(memory, T0 + timedelta(seconds=60), [alarm], serving=False)
    assert (passed.plan, reads) == (EPD3, 0)

    now = T0 + timedelta(seconds=60)
    passed, _ = _pass(memory, now, [alarm])
    assert passed.plan.pools == {Role.E: 2, Role.P: 1, Role.D: 1}
    assert passed.note is not None and passed.note.reason == "FastScaledUp"
    new = passed.memory
    assert new.plan is not None and new.plan.revision == 4 and new.last_change == now
    assert new.last_planned == T0 and new.planned_on is None  # the next re-plan runs on time
    why = new.decision
    assert why is not None and why.outcome == "FastScaledUp"
    assert (why.alarm, why.stage) == ("TTFT attainment 40% < 90%", "encode")
    assert (why.plan_before, why.plan, why.instances) == ("E+P+D 1E1P1D", "E+P+D 2E1P1D", 4)
    assert describe_decision(why).endswith(
        "encode bottleneck: E+P+D 1E1P1D -> E+P+D 2E1P1D, 4 GPUs"
    )
    # no alarm: nothing changes, and the fast path never scales down
    quiet, _ = _pass(new, now + timedelta(seconds=60), [])
    assert quiet.plan == passed.plan and quiet.note is None
