"""Discrete-event simulation of a whole plan on a trace, with a virtual clock.

Every instance is a real ``Scheduler`` (real KV / image page managers, real budgets, real
preemption); entry and migration targets are picked by the real routing policy from the
loads instances would report. Only time is modelled: an iteration takes ``cost.step_s`` of
its batch shape; a migration takes ``cost.migration_s`` and the source holds its pages until
the target has pulled them (DESIGN.md §4). Outputs ``RequestResult``s, so the same
``epd_engine.bench`` summary, attainment and goodput code reports on it.

With ``stop_on_failure`` the run ends as soon as enough requests have certainly missed the
SLO that attainment can no longer pass (the plan search only needs pass / fail).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from epd_engine.bench.metrics import RequestResult
from epd_engine.config import SLO, Stage
from epd_engine.plan import Plan
from epd_engine.profiler.budgets import derive_budgets
from epd_engine.profiler.cost_model import BatchShape, FittedCostModel
from epd_engine.profiler.jitter import Jitter
from epd_engine.profiler.sim_instance import RequestFactory, SimInstance, build_scheduler
from epd_engine.profiler.tracker import RequestTracker
from epd_engine.request import RequestStatus
from epd_engine.router.policy import LeastLoaded, RoutingPolicy, entry_candidates
from epd_engine.trace import TraceRecord

_ARRIVE, _STEP, _LAND, _DEADLINE = range(4)


@dataclass
class SimResult:
    results: list[RequestResult]
    stopped_early: bool = False
    num_steps: int = 0
    end_s: float = 0.0
    busy_s_by_role: dict[str, float] = field(default_factory=dict)


class Simulator:
    def __init__(
        self,
        plan: Plan,
        cost: FittedCostModel,
        slo: SLO | None = None,
        policy: RoutingPolicy | None = None,
        host_cores: float | None = None,
    ) -> None:
        """``host_cores``: all instances share this many CPU cores (local runs, ``epdctl up``
        on one machine); an iteration stretches by busy instances / cores when oversubscribed.
        None: every instance has its own device (GPU pods)."""
        self.plan = plan
        self.cost = cost
        self.host_cores = host_cores
        self.slo = slo or SLO()
        self.policy = policy or LeastLoaded()
        self.budgets = {}
        for role in plan.method.roles:
            budgets = plan.budgets.get(role) or derive_budgets(cost, role, self.slo)
            if budgets is not None:
                self.budgets[role] = budgets
        self.infeasible = len(self.budgets) < len(plan.method.roles)

    def run(self, records: Sequence[TraceRecord], stop_on_failure: bool = False) -> SimResult:
        return _Run(self, records, stop_on_failure).execute()


class _Run:
    """State of one simulation: instances, the event heap and per-request tracking."""

    def __init__(self, sim: Simulator, records: Sequence[TraceRecord], stop: bool) -> None:
        self.sim = sim
        self.cost = sim.cost
        self.records = records
        self.factory = RequestFactory(sim.cost)
        self.track = RequestTracker(records, sim.slo if stop else None)
        self.instances: list[SimInstance] = []
        if not sim.infeasible:
            for role in sim.plan.method.roles:
                for _ in range(sim.plan.pools[role]):
                    scheduler = build_scheduler(role, sim.budgets[role], sim.cost.capacity)
                    self.instances.append(SimInstance(len(self.instances), role, scheduler))
        static = [i.load() for i in self.instances]
        by_id = {i.instance_id: i for i in self.instances}
        self.entry = {
            has_images: [by_id[c.instance_id] for c in entry_candidates(static, has_images)]
            for has_images in (False, True)
        }
        self.runners = {  # migration targets: instances whose role runs the stage
            stage: [i for i in self.instances if i.role.runs(stage)] for stage in Stage
        }
        self.jitter = Jitter(sim.cost.overheads, seed=0)
        self.heap: list[tuple[float, int, int, int, str]] = []
        self.num_busy = 0  # instances mid-iteration (for host_cores sharing)
        self.seq = 0
        self.num_steps = 0

    def push(self, time_s: float, kind: int, index: int, key: str = "") -> None:
        self.seq += 1
        heapq.heappush(self.heap, (time_s, self.seq, kind, index, key))

    def execute(self) -> SimResult:
        if self.sim.infeasible:
            reason = "no batch budget meets the SLO on this cost model"
            return SimResult(self.track.results(reason))
        for index, record in enumerate(self.records):  # after router, HTTP, preprocessing
            self.push(record.arrival_s + self.jitter.request_s(), _ARRIVE, index)
        now = 0.0
        stopped = False
        while self.heap:
            now, _, kind, index, key = heapq.heappop(self.heap)
            if kind == _ARRIVE:
                self.arrive(index, now)
            elif kind == _STEP:
                self.finish_step(self.instances[index], now)
            elif kind == _LAND:
                self.land(index, key, now)
            else:
                self.track.deadline(index)
            if self.track.failed:
                stopped = True
                break
        busy: dict[str, float] = {}
        for inst in self.instances:
            busy[inst.role.value] = busy.get(inst.role.value, 0.0) + inst.busy_s
        reason = "stopped early: the SLO can no longer be met" if stopped else "never finished"
        return SimResult(self.track.results(reason), stopped, self.num_steps, now, busy)

    # ---- events ---------------------------------------------------------------------------
    def arrive(self, index: int, now: float) -> None:
        record = self.records[index]
        candidates = self.entry[bool(record.images)]
        if not candidates:
            self.track.fail(index, now, f"plan {self.sim.plan.describe()} has no entry pool")
            return
        loads = [c.load() for c in candidates]
        chosen = self.sim.policy.choose(loads)
        inst = candidates[loads.index(chosen)]
        request = self.factory.make(index, record)
        try:
            inst.scheduler.add(request)
        except ValueError as exc:
            self.track.fail(index, now, f"rejected: {exc}")
            return
        inst.changed()
        self.track.visit(index, request, inst.role.value)
        if self.track.slo is not None:
            self.push(record.arrival_s + self.track.slo.ttft_s, _DEADLINE, index)
        self.kick(inst, now)

    def kick(self, inst: SimInstance, now: float) -> None:
        """Start the next iteration if the instance is idle and its scheduler has work."""
        if inst.step is not None or not inst.scheduler.has_work():
            return
        inst.changed()
        out = inst.scheduler.schedule()
        self.note_errors(out.preempted_ids, now)
        if out.is_empty:  # admission alone (e.g. a landed decode) is an empty iteration
            out = inst.scheduler.schedule()
            self.note_errors(out.preempted_ids, now)
        if out.is_empty:
            return  # blocked on pages: a step or a released migration will kick it again
        step_s = self.cost.runner_step_s(BatchShape.of(out)) + self.jitter.step_s()
        self.num_busy += 1
        if self.sim.host_cores:  # processor sharing, fixed at the iteration's start
            step_s *= max(1.0, self.num_busy / self.sim.host_cores)
        inst.step = out
        inst.busy_s += step_s
        self.num_steps += 1
        self.push(now + step_s, _STEP, inst.index)

    def finish_step(self, inst: SimInstance, now: float) -> None:
        out = inst.step
        assert out is not None
        inst.step = None
        self.num_busy -= 1
        inst.changed()
        sampled = {t.request_id: 0 for t in out.token_tasks if t.sample}
        for event in inst.scheduler.update(out, sampled):
            index = int(event.request_id)
            self.track.token(index, now)
            if event.finish_reason is not None:
                self.track.finish(index, now)
        for request_id in list(inst.scheduler.migrating):
            if request_id not in inst.handed_off:
                inst.handed_off.add(request_id)
                self.hand_off(inst, request_id, now)
        self.kick(inst, now)

    def hand_off(self, source: SimInstance, request_id: str, now: float) -> None:
        request = source.scheduler.migrating[request_id]
        stage = request.next_stage
        targets = self.runners[stage]
        loads = [t.load() for t in targets]
        target = targets[loads.index(self.sim.policy.choose(loads))]
        target.changed()
        if stage is Stage.PREFILL:
            kind, num_tokens = "image", sum(i.num_tokens for i in request.images)
        else:
            kind, num_tokens = "kv", request.num_computed_tokens
        target.num_incoming += 1
        transfer_s = self.cost.migration_s(kind, num_tokens)
        self.track.migrated(int(request_id), kind, transfer_s)
        self.push(now + transfer_s, _LAND, target.index, f"{source.index}:{request_id}")

    def land(self, target_index: int, key: str, now: float) -> None:
        """The target pulled the pages: it owns the request, the source frees its copy."""
        source_index, request_id = key.split(":", 1)
        source = self.instances[int(source_index)]
        target = self.instances[target_index]
        request = source.scheduler.migrating[request_id]
        source.scheduler.release_migrated(request_id)
        source.handed_off.discard(request_id)
        source.changed()
        target.changed()
        target.num_incoming -= 1
        moved = replace(
            request, status=RequestStatus.WAITING, output_token_ids=list(request.output_token_ids)
        )
        index = int(request_id)
        try:
            target.scheduler.add(moved)
        except ValueError as exc:
            self.track.fail(index, now, f"rejected by {target.instance_id}: {exc}")
        else:
            self.track.visit(index, moved, target.role.value)
            self.kick(target, now)
        self.kick(source, now)

    def note_errors(self, preempted_ids: Sequence[str], now: float) -> None:
        for request_id in preempted_ids:
            index = int(request_id)
            if self.track.request(index).status is RequestStatus.FINISHED_ERROR:
                self.track.fail(index, now, "preempted on a decode-only instance")


def simulate(
    plan: Plan,
    records: Sequence[TraceRecord],
    cost: FittedCostModel,
    slo: SLO | None = None,
    stop_on_failure: bool = False,
    host_cores: float | None = None,
) -> SimResult:
    """Simulate ``plan`` serving ``records`` (arrivals as given)."""
    return Simulator(plan, cost, slo, host_cores=host_cores).run(records, stop_on_failure)
