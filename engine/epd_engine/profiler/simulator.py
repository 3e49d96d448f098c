"""Discrete-event simulation of a whole plan on a trace, with a virtual clock.

Every instance is a real ``Scheduler`` (real KV / image page managers, real budgets, real
preemption); entry and migration targets are picked by the real routing policy from the
loads instances would report. Only time is modelled: an iteration takes ``cost.step_s`` of
its batch shape. A migration follows the real four-step protocol (DESIGN.md §4): the offer
reaches the target after the calibrated hand-off latency and waits in its queue; the target's
scheduler admits it when it has pages (a ``PullTask``, as in the engine); the pull, issued
when that iteration ends, takes the calibrated pull latency plus ``cost.migration_s``; then
the request can run there and the source frees its pages. Outputs ``RequestResult``s (with
the router's per-stage seconds), so the same ``epd_engine.bench`` summary, attainment and
goodput code reports on it.

A trace with shared-prefix blocks (``hash_ids``) runs every instance with the engine's
prefix cache and routes by affinity, as the router does (``sim_prefix.py``): hits come from
each instance's pages, not from the trace. Otherwise a request's recorded ``cached_tokens``
are replayed (its prefill starts after them).

With ``stop_on_failure`` the run ends as soon as enough requests have certainly missed the
SLO that attainment can no longer pass (the plan search only needs pass / fail).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from epd_engine.config import SLO, Stage
from epd_engine.contracts.affinity import PrefixAffinity
from epd_engine.contracts.plan import Plan
from epd_engine.contracts.routing_policy import LeastLoaded, RoutingPolicy, first_stage
from epd_engine.contracts.trace import TraceRecord
from epd_engine.profiler.budgets import derive_budgets
from epd_engine.profiler.cost_model import FittedCostModel
from epd_engine.profiler.gc_pause import gc_paused
from epd_engine.profiler.jitter import Jitter
from epd_engine.profiler.placement import instance_groups, instance_nodes
from epd_engine.profiler.sim_instance import RequestFactory, SimInstance, build_scheduler
from epd_engine.profiler.sim_prefix import affinity_key, models_prefix_cache
from epd_engine.profiler.sim_routing import ScannedPool, routing_pool
from epd_engine.profiler.sim_scheduler import SimOutput, SimScheduler
from epd_engine.profiler.sim_sessions import whole_prompts
from epd_engine.profiler.steady_decodes import Run
from epd_engine.profiler.tensor_parallel import sized
from epd_engine.profiler.tracker import RequestTracker
from epd_engine.request import CacheKind, PullSpec, RequestStatus
from epd_engine.scheduler.output import PullTask
from epd_engine.slo.outcomes import RequestResult

_ARRIVE, _STEP, _OFFER, _PULLED, _DEADLINE, _FRONT = range(6)
_ENCODE, _PREFILL, _DECODE = Stage.ENCODE.value, Stage.PREFILL.value, Stage.DECODE.value


def cpu_share(plan: Plan, host_cores: float | None) -> float:
    """Processes per core when the plan's instances and its router share ``host_cores``
    (at least 1); 1 when every instance has its own device (``host_cores`` None).

    The calibrated migration protocol (hand-off, pull) is CPU work of those processes, so it
    scales with it (``Overheads``). The bench client is not counted: the plan does not
    include it."""
    if not host_cores:
        return 1.0
    return max(1.0, (plan.num_instances + 1) / host_cores)


@dataclass
class SimResult:
    results: list[RequestResult]
    stopped_early: bool = False
    num_steps: int = 0
    end_s: float = 0.0
    busy_s_by_role: dict[str, float] = field(default_factory=dict)
    num_remote_pulls: int = 0  # migrations between two nodes (``instances_per_node``)
    # prefix cache (modelled, ``sim_prefix.py``): prompt tokens looked up and found, by role
    prefix_queried_tokens: dict[str, int] = field(default_factory=dict)
    prefix_hit_tokens: dict[str, int] = field(default_factory=dict)

    def prefix_hit_rate(self, role: str) -> float | None:
        queried = self.prefix_queried_tokens.get(role, 0)
        return self.prefix_hit_tokens.get(role, 0) / queried if queried else None


class Simulator:
    def __init__(
        self,
        plan: Plan,
        cost: FittedCostModel,
        slo: SLO | None = None,
        policy: RoutingPolicy | None = None,
        host_cores: float | None = None,
        scheduler_kind: type[SimScheduler] = SimScheduler,
        instances_per_node: int | None = None,
        indexed_routing: bool = True,
        grouped: bool = False,
        steady_decodes: bool = True,
    ) -> None:
        """``host_cores``: all instances share this many CPU cores (local runs, ``epdctl up``
        on one machine); an iteration stretches by busy instances / cores when oversubscribed,
        and calibrated overheads by the plan's ``cpu_share``. None: every instance has its
        own device (GPU pods). ``scheduler_kind``: ``EngineScheduler`` runs the engine's own
        scheduler code step by step (the reference the fast path is tested against).
        ``instances_per_node``: how many instances share a node (``placement.py``); a
        migration between nodes is charged ``cost.remote_migration`` and a source prefers a
        target on its own node (``contracts/node_locality.py``). None: all on one node.
        ``indexed_routing``: False reads every instance's load for every pick (the reference
        ``sim_routing.IndexedPool`` is tested against). ``grouped``: placement groups, one pod
        per slice (``placement.instance_groups``, in place of nodes): a source prefers its
        group's target, as ``contracts/group_locality.py``, and a hand-off across groups is
        charged ``cost.remote_migration``. ``steady_decodes``: plain decodes advance as one
        cohort per instance where that is exact (``steady_decodes.py``); False walks every
        request every iteration (the reference it is tested against)."""
        self.steady_decodes = steady_decodes
        self.instances_per_node = instances_per_node
        self.grouped = grouped
        self.indexed_routing = indexed_routing
        self.scheduler_kind = scheduler_kind
        self.plan = plan
        self.cost = cost
        # each pool's instances at their tensor-parallel size (the plan's; 1: ``cost``)
        self.role_cost = {role: sized(cost, plan.size_of(role)) for role in plan.method.roles}
        self.host_cores = host_cores
        self.slo = slo or SLO()
        # None: least loaded, or by prefix affinity when the cache is modelled (the router's)
        self.policy = policy
        self.budgets = {}
        for role in plan.method.roles:
            budgets = plan.budgets.get(role) or derive_budgets(self.role_cost[role], role, self.slo)
            if budgets is not None:
                self.budgets[role] = budgets
        self.infeasible = len(self.budgets) < len(plan.method.roles)

    def run(
        self, records: Sequence[TraceRecord], stop_on_failure: bool = False, seed: int = 0
    ) -> SimResult:
        """``seed``: of the calibrated jitter's draws (same seed, same result). A session's
        turns are served as whole prompts (``sim_sessions.py``)."""
        with gc_paused():
            return _Run(self, whole_prompts(records), stop_on_failure, seed).execute()


class _Run:
    """State of one simulation: instances, the event heap and per-request tracking."""

    def __init__(
        self, sim: Simulator, records: Sequence[TraceRecord], stop: bool, seed: int = 0
    ) -> None:
        self.sim = sim
        self.cost = sim.cost
        self.records = records
        self.prefix_cache = models_prefix_cache(records)
        self.factory = RequestFactory(sim.cost, self.prefix_cache, records=records)
        self.policy: RoutingPolicy = sim.policy or (
            PrefixAffinity() if self.prefix_cache else LeastLoaded()
        )
        silent = sim.cost.overheads.silent_tokens
        self.track = RequestTracker(records, sim.slo if stop else None, silent, seed)
        # a steady cohort is exact when a gap is one iteration and tokens are plain
        steady = sim.steady_decodes and not silent and not self.prefix_cache
        self.instances: list[SimInstance] = []
        if not sim.infeasible:
            for role in sim.plan.method.roles:
                for _ in range(sim.plan.pools[role]):
                    scheduler = build_scheduler(
                        role,
                        sim.budgets[role],
                        sim.role_cost[role].capacity,
                        sim.scheduler_kind,
                        self.prefix_cache,
                    )
                    scheduler.answers = self.factory.answers  # what each request generates
                    if steady:
                        scheduler.enable_steady()
                    self.instances.append(SimInstance(len(self.instances), role, scheduler))
        pools = [(role, sim.plan.pools[role]) for role in sim.plan.method.roles]
        nodes = instance_nodes(pools, sim.instances_per_node) if self.instances else []
        if sim.grouped and self.instances:  # a group is a "node": its pod's link inside
            nodes = instance_groups(pools)
        self.multi_node = any(nodes)
        for inst, node in zip(self.instances, nodes, strict=True):
            inst.node = str(node)
        self.num_remote_pulls = 0
        # migration targets: instances whose role runs the stage (one pool per set of them)
        by_members: dict[tuple[int, ...], ScannedPool] = {}
        self.runners: dict[Stage, ScannedPool] = {}
        for stage in Stage:
            members = [i for i in self.instances if i.role.runs(stage)]
            key = tuple(i.index for i in members)
            if key not in by_members:
                by_members[key] = routing_pool(members, self.policy, sim.indexed_routing)
            self.runners[stage] = by_members[key]
        # where a request enters: the instances that run its first stage
        self.entry = {images: self.runners[first_stage(images)] for images in (False, True)}
        self.jitter = Jitter(sim.cost.overheads, seed, cpu_share(sim.plan, sim.host_cores))
        self.sources: dict[tuple[int, str], int] = {}  # (target, request id) -> source index
        self.heap: list[tuple[float, int, int, int, str]] = []
        self.num_busy = 0  # instances mid-iteration (for host_cores sharing)
        self.shared_host = bool(sim.host_cores)
        self.front_work: dict[int, float] = {}  # request index -> its front's seconds alone
        self.entry_of: dict[int, SimInstance] = {}  # request index -> where its front runs
        self.host_front: SimInstance | None = None  # the instance running the host's front
        self.seq = 0
        self.num_steps = 0

    def push(self, time_s: float, kind: int, index: int, key: str = "") -> None:
        self.seq += 1
        heapq.heappush(self.heap, (time_s, self.seq, kind, index, key))

    def execute(self) -> SimResult:
        if self.sim.infeasible:
            reason = "no batch budget meets the SLO on this cost model"
            return SimResult(self.track.results(reason))
        # On a shared host a request's front work (router, HTTP, preprocessing) waits for the
        # previous one's: 2 cores, 5 processes. Measured: TTFT outside the stages is 4-7 ms
        # longer (median) when the previous request came < 40 ms before; one FIFO front
        # with the calibrated overhead reproduces it (``front``). With own devices they
        # overlap. The draws come first, in arrival order: a seed gives the same fronts.
        order = sorted(range(len(self.records)), key=lambda i: self.records[i].arrival_s)
        for index in order:
            self.front_work[index] = self.jitter.request_s()
        for index in order:
            arrival_s = self.records[index].arrival_s
            if self.shared_host:
                self.push(arrival_s, _FRONT, index)
            else:
                self.push(arrival_s + self.front_work[index], _ARRIVE, index)
        now = 0.0
        stopped = False
        while self.heap:
            now, _, kind, index, key = heapq.heappop(self.heap)
            if kind == _ARRIVE:
                self.arrive(index, now)
            elif kind == _FRONT:
                self.front(index, now)
            elif kind == _STEP:
                self.finish_step(self.instances[index], now)
            elif kind == _OFFER:
                self.offer(index, key, now)
            elif kind == _PULLED:
                self.pulled(index, key, now)
            else:
                self.track.deadline(index)
            if self.track.failed:
                stopped = True
                break
        for inst in self.instances:  # the steady tokens not yet written back
            self.write_back(inst, inst.scheduler.flush_steady())
        busy: dict[str, float] = {}
        for inst in self.instances:
            busy[inst.role.value] = busy.get(inst.role.value, 0.0) + inst.busy_s
        reason = "stopped early: the SLO can no longer be met" if stopped else "never finished"
        results = self.track.results(reason)
        result = SimResult(results, stopped, self.num_steps, now, busy, self.num_remote_pulls)
        for inst in self.instances:
            kv = inst.scheduler.kv
            if kv is not None and kv.hasher is not None:
                role = inst.role.value
                queried = result.prefix_queried_tokens
                queried[role] = queried.get(role, 0) + kv.num_queried_tokens
                hits = result.prefix_hit_tokens
                hits[role] = hits.get(role, 0) + kv.num_hit_tokens
        return result

    # ---- events ---------------------------------------------------------------------------
    def front(self, index: int, now: float) -> None:
        """Shared host: a request's front starts once the previous one's is done (one FIFO),
        on the entry instance the router picks now. Iterations on the host meanwhile stretch
        it by the calibrated ``front_contention`` (those already running by what is left of
        them, later ones in ``kick``)."""
        if self.host_front is not None and self.host_front.front_until > now:
            self.push(self.host_front.front_until, _FRONT, index)  # FIFO: ties keep order
            return
        inst = self.choose_entry(index, now)
        if inst is None:
            return
        work = self.front_work[index]
        contention = self.cost.overheads.front_contention
        running = sum(min(work, i.step_end - now) for i in self.instances if i.step is not None)
        inst.front_until = now + work + contention * running
        inst.front_index = index
        self.host_front = inst
        self.entry_of[index] = inst
        self.push(inst.front_until, _ARRIVE, index)

    def choose_entry(self, index: int, now: float) -> SimInstance | None:
        pool = self.entry[bool(self.records[index].images)]
        if not pool.members:
            self.track.fail(index, now, f"plan {self.sim.plan.describe()} has no entry pool")
            return None
        chosen, _ = pool.choose(affinity_key(self.records[index]))
        return chosen

    def arrive(self, index: int, now: float) -> None:
        """The request's front is done: it queues on its entry instance."""
        record = self.records[index]
        if self.shared_host:
            inst = self.entry_of[index]
            if inst.front_index == index and inst.front_until > now:  # iterations stretched it
                self.push(inst.front_until, _ARRIVE, index)
                return
            del self.entry_of[index]
        else:
            chosen = self.choose_entry(index, now)
            if chosen is None:
                return
            inst = chosen
        request = self.factory.make(index, record)
        try:
            inst.scheduler.add(request)
        except ValueError as exc:
            self.track.fail(index, now, f"rejected: {exc}")
            return
        inst.changed()
        self.track.visit(index, request, inst.role.value)
        self.track.stage_ready(index, request.next_stage.value, now)
        if self.track.slo is not None:
            self.push(record.arrival_s + self.track.slo.ttft_s, _DEADLINE, index)
        self.kick(inst, now)

    def kick(self, inst: SimInstance, now: float) -> None:
        """Start the next iteration if the instance is idle and its scheduler has work."""
        if inst.step is not None or not inst.scheduler.has_work():
            return
        inst.changed()
        out = inst.scheduler.schedule()
        if out.preempted_ids:
            self.note_errors(out.preempted_ids, now)
        if out.is_empty:  # admission alone (e.g. a landed decode) is an empty iteration
            out = inst.scheduler.schedule()
            if out.preempted_ids:
                self.note_errors(out.preempted_ids, now)
        if out.is_empty:
            # Nothing to run, but the engine still applies the empty iteration: a request
            # admitted with nothing to do here (every image in the encoder cache) moves on
            # to the next stage's instance (it once stayed on E for good).
            self.write_back(inst, inst.scheduler.apply(out).runs)
            self.hand_off_migrating(inst, now)
            return  # blocked on pages: a step or a released migration will kick it again
        step_s = self.sim.role_cost[inst.role].runner_step_s(out.shape()) + self.jitter.step_s()
        overheads = self.cost.overheads
        if out.encodes:
            step_s += overheads.encode_s
        if out.prefills and not inst.role.decodes:  # its KV is exported while it prefills
            step_s += overheads.export_s
        self.num_busy += 1
        if self.sim.host_cores:  # processor sharing, fixed at the iteration's start
            step_s *= max(1.0, self.num_busy / self.sim.host_cores)
        if (front := self.host_front) is not None and front.front_until > now:
            # A front runs on the host: it slows by the CPU this iteration takes; in its own
            # process, the iteration runs at half speed while they overlap (the GIL).
            overlap = min(step_s, front.front_until - now)
            if front is inst:
                step_s += overlap
            front.front_until += self.cost.overheads.front_contention * overlap
        inst.step_end = now + step_s
        inst.step = out
        inst.busy_s += step_s
        for encode in out.encodes:
            self.track.stage_started(int(encode.request_id), _ENCODE, now)
        for task in out.prefills:
            self.track.stage_started(int(task.request_id), _PREFILL, now)
        if out.decoding:
            self.track.decodes_started(out.decoding, now)
        self.num_steps += 1
        self.push(now + step_s, _STEP, inst.index)

    def finish_step(self, inst: SimInstance, now: float) -> None:
        out = inst.step
        assert out is not None
        inst.step = None
        self.num_busy -= 1
        inst.changed()
        applied = inst.scheduler.apply(out)
        if applied.runs:
            self.write_back(inst, applied.runs)
        if applied.steady:
            self.steady_tick(inst, now)
        inst.last_step_end = now
        if applied.tokens:
            self.track.tokens(applied.tokens, now)
        for request_id in applied.finished:
            index = int(request_id)
            self.track.stage_done(index, _DECODE, now)  # no-op if it ended at prefill
            self.track.finish(index, now)
        if out.encodes or out.prefills:
            self.note_stages(inst, out, now)
        for task in out.pulls:  # step 2 done: the engine issues the pull after the iteration
            self.pull(inst, task, now)
        if inst.scheduler.migrating:
            self.hand_off_migrating(inst, now)
        self.kick(inst, now)

    def write_back(self, inst: SimInstance, runs: Sequence[Run]) -> None:
        """Steady tokens written back: their times are the ticks' stamps."""
        stamps = inst.steady_stamps
        for run in runs:
            self.track.token_run(int(run.request_id), stamps[run.first : run.first + run.count])

    def steady_tick(self, inst: SimInstance, now: float) -> None:
        """The cohort ran in this iteration: stamp it; each member's gap is the iteration
        (iterations run back to back while it has members), late ones counted now."""
        inst.steady_stamps.append(now)
        slo = self.track.slo
        if slo is not None and now - inst.last_step_end > slo.tpot_s:
            steady = inst.scheduler.steady
            assert steady is not None
            tick = steady.tick - 1  # the members that joined this iteration took no tick
            for request_id, member in steady.members.items():
                if member.join <= tick:
                    self.track.late_gap(int(request_id))

    def hand_off_migrating(self, inst: SimInstance, now: float) -> None:
        for request_id in list(inst.scheduler.migrating):
            if request_id not in inst.handed_off:
                inst.handed_off.add(request_id)
                self.hand_off(inst, request_id, now)

    def note_stages(self, inst: SimInstance, out: SimOutput, now: float) -> None:
        """Close the stages a request moved past this iteration; its next local one is ready.
        (Decode is the last stage: it closes when the request finishes.)"""
        ran = {(t.request_id, Stage.ENCODE) for t in out.encodes}
        ran.update((t.request_id, Stage.PREFILL) for t in out.prefills)
        sched = inst.scheduler
        for request_id, stage in ran:
            request = sched.requests.get(request_id)
            current = None if request is None or request.status.finished else request.next_stage
            if current is stage:
                continue
            index = int(request_id)
            self.track.stage_done(index, stage.value, now)
            if current is not None and request_id not in sched.migrating:
                self.track.stage_ready(index, current.value, now)

    def hand_off(self, source: SimInstance, request_id: str, now: float) -> None:
        """Step 1: offer the request to the least-loaded target; it queues it on arrival."""
        request = source.scheduler.migrating[request_id]
        pool = self.runners[request.next_stage]
        # prefill and decode follow the conversation's pages (peers.py); images do not
        keyed = request.next_stage is not Stage.ENCODE
        prefix = affinity_key(self.records[int(request_id)]) if keyed else None
        target, followed = pool.choose(prefix)
        if self.sim.grouped:  # its group's peer before the key's, as peers.py
            least = pool.choose(None)[0] if followed else target
            target = pool.near(source.node, least) or target
        elif self.multi_node and not followed:  # a peer on the source's node, as peers.py
            target = pool.near(source.node, target) or target
        target.changed()
        target.num_incoming += 1
        key = f"{source.index}:{request_id}"
        image = request.next_stage is Stage.PREFILL  # an image hop, else KV
        handoff_s = self.jitter.image_handoff_s() if image else self.jitter.handoff_s()
        self.push(now + handoff_s, _OFFER, target.index, key)

    def offer(self, target_index: int, key: str, now: float) -> None:
        """The offer arrived: the target queues the request; it pulls once admitted."""
        source_index, request_id = key.split(":", 1)
        source = self.instances[int(source_index)]
        target = self.instances[target_index]
        request = source.scheduler.migrating[request_id]
        target.changed()
        target.num_incoming -= 1
        kind = CacheKind.IMAGE if request.next_stage is Stage.PREFILL else CacheKind.KV
        moved = replace(
            request,
            status=RequestStatus.WAITING,
            output_token_ids=list(request.output_token_ids),
            pull=PullSpec(kind, source_url="", source_instance=source.instance_id),
            pulling=False,
        )
        index = int(request_id)
        try:
            target.scheduler.add(moved)
        except ValueError as exc:
            self.track.fail(index, now, f"rejected by {target.instance_id}: {exc}")
            self.release_source(source, request_id, now)
            return
        self.sources[(target_index, request_id)] = source.index
        self.track.visit(index, moved, target.role.value)
        self.track.stage_ready(index, moved.next_stage.value, now)
        self.kick(target, now)

    def pull(self, target: SimInstance, task: PullTask, now: float) -> None:
        """Steps 2-3: fetch the pages (nothing to fetch when every image is cached here)."""
        request = target.scheduler.requests[task.request_id]
        remote = False
        if self.multi_node:
            source = self.instances[self.sources[(target.index, task.request_id)]]
            remote = source.node != target.node
            self.num_remote_pulls += remote
        if task.kind is CacheKind.IMAGE:
            num_tokens = sum(request.images[i].num_tokens for i in task.image_blocks)
            pull_s = 0.0
            if num_tokens:
                pull_s = self.jitter.pull_s() + self.cost.migration_s("image", num_tokens, remote)
        else:  # pages the target's prefix cache holds are not pulled
            num_tokens = (
                task.num_kv_tokens - task.num_held_kv_pages * self.cost.capacity.kv_block_size
            )
            pull_s = self.jitter.kv_pull_s() + self.cost.migration_s("kv", num_tokens, remote)
        self.track.migrated(int(task.request_id), task.kind.value, pull_s)
        self.push(now + pull_s, _PULLED, target.index, task.request_id)

    def pulled(self, target_index: int, request_id: str, now: float) -> None:
        """Step 4: the pages landed; the target may run the request, the source frees them."""
        target = self.instances[target_index]
        target.scheduler.pull_done(request_id)
        target.changed()
        source = self.instances[self.sources.pop((target_index, request_id))]
        self.kick(target, now)
        self.release_source(source, request_id, now)

    def release_source(self, source: SimInstance, request_id: str, now: float) -> None:
        source.scheduler.release_migrated(request_id)
        source.handed_off.discard(request_id)
        source.changed()
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
    seed: int = 0,
) -> SimResult:
    """Simulate ``plan`` serving ``records`` (arrivals as given)."""
    return Simulator(plan, cost, slo, host_cores=host_cores).run(records, stop_on_failure, seed)
