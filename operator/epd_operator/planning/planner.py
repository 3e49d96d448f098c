"""Auto mode's planner: the trace-replay profiler on the router's live trace window.

Pure (no kopf, no Kubernetes client): the controller hands it the trace window, the spec and
a cost model. ``profiler_plan`` runs the plan search of ``epdctl plan`` (every method and
every ratio for the instances the GPU budget pays for, scored by simulated goodput at the
spec's SLOs); ``bounded_profiler_plan`` runs it in a child process that is killed at a time
limit, so a reconcile pass never blocks for long; ``auto_planner`` is what ``choose_plan``
calls: the profiler when the window has ``profiler.minRequests`` records, else the heuristic
(``loop.heuristic_plan``) with a reason saying why. ``workload_stats`` measures the window for
the shift and SLO-attainment triggers, so Auto mode needs no Prometheus.
"""

from __future__ import annotations

import json
import multiprocessing
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection

from tqdm import tqdm

from epd_engine.config import SLO, Method, Role
from epd_engine.contracts.plan import Plan
from epd_engine.contracts.trace import TraceRecord, sort_by_arrival
from epd_engine.profiler.candidates import ALL_METHODS, Candidate
from epd_engine.profiler.cost_model import FittedCostModel
from epd_engine.profiler.evaluate import Evaluation, Evaluator
from epd_engine.profiler.links import link_backend
from epd_engine.profiler.reference import reference_cost_model
from epd_engine.profiler.search import Hint, SearchResult, exhaustive_search, to_plan
from epd_operator.api.spec import EPDDeploymentSpec
from epd_operator.planning.choice import (
    Planner,
    PlanningError,
    Proposal,
    WorkloadStats,
    heuristic_plan,
    instance_range,
    is_elastic,
)
from epd_operator.planning.levelled import levelled
from epd_operator.planning.sizing import fewest_instances, start_size

MAX_PLAN_REQUESTS = 1000  # larger windows are sampled evenly down to this many requests
PLAN_TIMEOUT_S = 60.0
REFERENCE_LABEL = "built-in synthetic reference (LLaVA-1.5-7B fp16, H800-class GPU)"

# () -> (cost model, how to name it in the plan's reason); ValueError when it cannot be read.
CostSource = Callable[[], tuple[FittedCostModel, str]]


def reference_cost() -> tuple[FittedCostModel, str]:
    return reference_cost_model(), REFERENCE_LABEL


def cost_model_from_json(text: str, source: str) -> FittedCostModel:
    """A cost model JSON (``epdctl profile-costs``); ValueError naming ``source`` if it is not."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source}: not valid JSON ({exc.msg})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{source}: not a cost model (expected a JSON object)")
    return FittedCostModel.from_dict(data, source=source)


# --- the workload ----------------------------------------------------------------------------


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def workload_stats(
    records: Sequence[TraceRecord], window_s: float, slo: SLO | None = None
) -> WorkloadStats:
    """Rate and per-request means of a trace window covering ``window_s`` seconds.

    With ``slo``, attainment is the share of the records that carry a measured TTFT and
    meet both SLOs (the router records finished requests only, so failures do not count).
    """
    measured = [r for r in records if r.ttft_s is not None]
    attainment = None
    if slo is not None and measured:
        met = sum(
            (r.ttft_s or 0.0) <= slo.ttft_s and (r.tpot_p90_s or 0.0) <= slo.tpot_s
            for r in measured
        )
        attainment = met / len(measured)
    return WorkloadStats(
        num_requests=len(records),
        request_rate_rps=len(records) / window_s if window_s > 0 else 0.0,
        mean_prompt_tokens=_mean([r.prompt_tokens for r in records]),
        mean_images=_mean([r.num_images for r in records]),
        mean_output_tokens=_mean([r.output_tokens for r in records]),
        slo_attainment=attainment,
        window_s=window_s,
    )


def subsample(records: Sequence[TraceRecord], max_requests: int) -> list[TraceRecord]:
    """At most ``max_requests`` records, evenly spaced in arrival order (deterministic), so the
    sample keeps the window's mix and arrival pattern; rebased to start at 0."""
    ordered = sort_by_arrival(records)
    if len(ordered) > max_requests:
        ordered = [ordered[i * len(ordered) // max_requests] for i in range(max_requests)]
    start_s = ordered[0].arrival_s if ordered else 0.0
    return [r.model_copy(update={"arrival_s": r.arrival_s - start_s}) for r in ordered]


# --- the profiler ----------------------------------------------------------------------------


def profiler_plan(
    spec: EPDDeploymentSpec,
    records: Sequence[TraceRecord],
    cost: FittedCostModel,
    cost_label: str = "",
    max_requests: int = MAX_PLAN_REQUESTS,
    num_in_window: int | None = None,
) -> Plan:
    """The highest-goodput plan for the trace, by exhaustive simulated search (see
    ``profiler_proposal``)."""
    return profiler_proposal(spec, records, cost, cost_label, max_requests, num_in_window).plan


def methods_for(records: Sequence[TraceRecord]) -> list[Method]:
    """Every method, except those with an encode-only pool when no request has an image."""
    if any(r.num_images for r in records):
        return list(ALL_METHODS)
    return [m for m in ALL_METHODS if Role.E not in m.roles]


def profiler_proposal(
    spec: EPDDeploymentSpec,
    records: Sequence[TraceRecord],
    cost: FittedCostModel,
    cost_label: str = "",
    max_requests: int = MAX_PLAN_REQUESTS,
    num_in_window: int | None = None,
    current: Plan | None = None,
    same_host: bool = False,
    target_rps: float | None = None,
) -> Proposal:
    """The highest-goodput plan for the trace, by exhaustive simulated search, and the
    ``current`` plan's goodput simulated on the same sample (to compare them fairly).

    Candidates: every method and ratio for the most instances ``spec.capacity`` allows (no
    encode-only pool for text-only traffic), at the spec's TTFT/TPOT SLOs. With an elastic
    capacity and ``target_rps`` (the rate to serve, headroom included): for the fewest
    instances whose best plan's goodput covers it (``sizing.fewest_instances``) on the window
    at a level rate (``levelled``: the forecast has its level changes), and the
    ``current`` plan when it has that many instances and covers it too (ties go to the
    current plan). The plan carries
    ``predicted`` (goodput, p90 TTFT/TPOT at it) and its trace provenance; batch budgets are
    left out (each engine measures its own at start-up). ``num_in_window``: how many requests
    ``records`` was sampled from, if it was. ``same_host``: every instance runs on one host
    (``epdctl up``), so ``auto`` transfers map a peer's memory. Raises PlanningError when no
    candidate meets the SLOs at any rate.
    """
    if not records:
        raise PlanningError("the trace window is empty")
    sample = subsample(records, max_requests)
    low, high = instance_range(spec)
    sizes = target_rps is not None and low < high
    if sizes:  # the forecast reads the window's level changes; the sizing must not again
        sample = levelled(sample)
    # Pods have their own network namespaces: auto cannot map a peer's memory, it uses tcp;
    # in a group pod it can, for the members (epdctl up runs all on one host, ungrouped)
    grouped = spec.placement.grouped and not same_host
    backend = spec.engine.transfer_backend
    cost = cost.for_groups(backend) if grouped else cost.for_backend(backend, same_host)
    slo = spec.slo.to_slo()
    methods = methods_for(sample)
    evaluator = Evaluator(sample, cost, slo, grouped=grouped)
    tp_sizes = tuple(spec.disaggregation.tensor_parallel_sizes)
    try:
        for size in tp_sizes:
            evaluator.cost_at(size)
    except ValueError as exc:  # no rank terms, or a size the model cannot be cut into
        raise PlanningError(f"disaggregation.tensorParallelSizes: {exc}") from exc

    def search_in(num_instances: int, among: Sequence[Method]) -> SearchResult:
        hint = previous_hint(current, num_instances, among)
        return exhaustive_search(evaluator, num_instances, among, False, 1, hint, tp_sizes)

    def search(num_instances: int) -> SearchResult:
        return search_in(num_instances, methods)

    sizing = ""
    if sizes and target_rps is not None:
        near = start_size(current, target_rps)
        sized = fewest_instances(search, low, high, target_rps, near)
        num_instances, result = sized.num_instances, sized.result
        short = "" if sized.covers else ", the most allowed, short of it"
        sizing = (
            f"; {num_instances} instances for {target_rps:.3g} rps (forecast x headroom{short}; "
            f"{sized.num_searches} sizes searched in [{low}, {high}])"
        )
    else:
        num_instances, result = high, search(high)
    at = f"TTFT<={slo.ttft_s:g}s, TPOT<={slo.tpot_s:g}s"
    if result.best is None:
        raise PlanningError(
            f"none of {result.num_candidates} plans for {num_instances} instances meets {at} "
            f"at any rate on this cost model"
        )
    total = max(num_in_window or 0, len(records))
    on = f"{len(sample)} requests"
    if len(sample) < total:
        on = f"{len(sample)} of {total} requests (evenly sampled)"
    if len(methods) < len(ALL_METHODS):
        on += ", text only"
    if sizes:
        on += ", at a level rate"
    label = cost_label or str(cost.meta.get("source", "unnamed"))
    link = f", {cost.transfer_backend} link" if cost.transfer_backend else ""
    if link and grouped and (across := link_backend(backend, same_host=False)) in cost.links:
        link += f" in a group pod, {across} across"
    reason = (
        f"profiler: best of {result.num_candidates} plans on {on} at {at} "
        f"({result.num_pruned} pruned by bound); cost model: {label}{link}{sizing}"
    )
    plan = _plan_of(evaluator, result.best, reason)
    current_rps = None
    if current is not None and current.num_ranks == num_instances:
        current_rps = searched_goodput(result.evaluations, candidate_of(current))
        if current_rps is None:  # the search did not need its exact goodput
            current_rps = simulated_goodput(evaluator, current)
        if sizing and target_rps is not None and current_rps >= target_rps:
            # as few instances as the best, and it covers the target too: a tie, kept
            why = f"{current.describe()} kept: it covers the rate too{sizing}"
            plan = current.model_copy(update={"reason": why})
    if sizing and target_rps is not None and current is not None:
        plan = _current_method_if_it_covers(
            plan, current, methods, target_rps, sizing, search_in, evaluator
        )
    return Proposal(plan, current_rps, evaluator.num_simulations)


def _current_method_if_it_covers(
    plan: Plan,
    current: Plan,
    methods: Sequence[Method],
    target_rps: float,
    sizing: str,
    search_in: Callable[[int, Sequence[Method]], SearchResult],
    evaluator: Evaluator,
) -> Plan:
    """A tie at the size goes to the current *method*: when its best ratio at ``plan``'s
    instance count covers the target too, that ratio (its pools are resized in place; a
    method switch starts every pool anew). Without it the loop switched between methods
    whose goodput differs by less than the search's rate step (EP+D and ED+P on the
    reference cost model) at nearly every size change of a simulated day."""
    method = current.method
    if plan.method == method or method not in methods:
        return plan
    same = search_in(plan.num_ranks, [method])
    if same.best is None or (same.best.goodput_rps or 0.0) < target_rps:
        return plan
    why = (
        f"{method} kept: its best ratio covers the rate too (best of {same.num_candidates} "
        f"{method} plans; {plan.describe()} would switch method){sizing}"
    )
    return _plan_of(evaluator, same.best, why)


def _plan_of(evaluator: Evaluator, evaluation: Evaluation, why: str) -> Plan:
    """The searched plan, without batch budgets (each engine measures its own at start-up)."""
    return to_plan(evaluator, evaluation, why).model_copy(update={"budgets": {}})


def candidate_of(plan: Plan) -> Candidate:
    sizes = tuple(plan.size_of(r) for r in plan.method.roles) if plan.tensor_parallel else ()
    return Candidate(plan.method, tuple(plan.pools[r] for r in plan.method.roles), sizes)


def previous_hint(
    current: Plan | None, num_instances: int, methods: Sequence[Method]
) -> Hint | None:
    """The current plan, searched first from the goodput predicted for it: a re-plan on a
    window that has not moved settles in a few simulations. Speed only: the search finds the
    same plan without it."""
    if current is None or current.predicted is None or current.predicted.goodput_rps <= 0:
        return None
    if current.num_ranks != num_instances or current.method not in methods:
        return None
    return Hint(candidate_of(current), current.predicted.goodput_rps)


def searched_goodput(evaluations: Sequence[Evaluation], candidate: Candidate) -> float | None:
    """``candidate``'s goodput if the search settled it exactly (on the same rate grid as the
    plan it chose, so the two compare like for like); the hinted current plan always is."""
    for evaluation in evaluations:
        if evaluation.candidate == candidate and evaluation.status == "searched":
            return evaluation.goodput_rps
    return None


def simulated_goodput(evaluator: Evaluator, plan: Plan) -> float:
    """``plan``'s goodput on the evaluator's trace (0 when it meets the SLOs at no rate)."""
    candidate = candidate_of(plan)
    bound = evaluator.bound(candidate)
    if bound <= 0:
        return 0.0
    finite = bound != float("inf")
    start = max(1e-3, bound / 2) if finite else 1.0
    found = evaluator.searched(candidate, bound if finite else 1e6, start)
    return found.goodput_rps or 0.0


def _plan_in_child(
    conn: Connection,
    spec: EPDDeploymentSpec,
    records: list[TraceRecord],
    cost: FittedCostModel,
    cost_label: str,
    num_in_window: int,
    current: Plan | None,
    same_host: bool,
    target_rps: float | None,
) -> None:
    # tqdm's default lock is a multiprocessing semaphore the parent's resource tracker would
    # report as leaked when this process ends; the search is single-threaded here.
    tqdm.set_lock(threading.RLock())
    try:
        got = profiler_proposal(
            spec,
            records,
            cost,
            cost_label,
            len(records),
            num_in_window,
            current,
            same_host,
            target_rps,
        )
        reply = (got.plan.model_dump_json(), got.current_goodput_rps, got.num_simulations)
        conn.send((True, reply))
    except PlanningError as exc:
        conn.send((False, str(exc)))
    except Exception as exc:  # a bug: reported, and the parent falls back to the heuristic
        conn.send((False, f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def bounded_profiler_plan(
    spec: EPDDeploymentSpec,
    records: Sequence[TraceRecord],
    cost: FittedCostModel,
    cost_label: str = "",
    timeout_s: float = PLAN_TIMEOUT_S,
    max_requests: int = MAX_PLAN_REQUESTS,
    current: Plan | None = None,
    same_host: bool = False,
    target_rps: float | None = None,
) -> Proposal:
    """``profiler_proposal`` in a child process (spawned: the operator's threads are not forked),
    killed after ``timeout_s``. Raises PlanningError on time-out or failure. Spawning
    re-imports the main module, so a script calling this needs ``if __name__ == "__main__"``
    (``kopf run`` and pytest have it)."""
    if not records:
        raise PlanningError("the trace window is empty")
    sample = subsample(records, max_requests)
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(
        target=_plan_in_child,
        args=(send, spec, sample, cost, cost_label, len(records), current, same_host, target_rps),
        name="epd-plan-search",
        daemon=True,
    )
    child.start()
    send.close()
    try:
        if not receive.poll(timeout_s):
            raise PlanningError(f"the plan search took longer than {timeout_s:g} s")
        try:
            ok, payload = receive.recv()
        except EOFError:
            raise PlanningError(
                f"the plan search process died (exit code {child.exitcode})"
            ) from None
    finally:
        if child.is_alive():
            child.kill()
        child.join(timeout=5)
        receive.close()
    if not ok:
        raise PlanningError(payload)
    plan_json, current_rps, num_simulations = payload
    return Proposal(Plan.model_validate_json(plan_json), current_rps, num_simulations)


def target_rate(spec: EPDDeploymentSpec, stats: WorkloadStats | None) -> float | None:
    """The rate an elastic capacity is sized for: the forecast rate (``plan_pass`` sets it;
    unset: the window's rate) plus the headroom (None: a fixed size, or no rate measured)."""
    if not is_elastic(spec) or stats is None:
        return None
    rate = stats.forecast_rps if stats.forecast_rps is not None else stats.request_rate_rps
    return rate * (1 + spec.capacity.headroom_percent / 100)


def auto_planner(
    records: Sequence[TraceRecord] | None,
    cost_source: CostSource = reference_cost,
    *,
    no_trace_why: str = "router trace unavailable",
    timeout_s: float = PLAN_TIMEOUT_S,
    max_requests: int = MAX_PLAN_REQUESTS,
    same_host: bool = False,
) -> Planner:
    """The planner ``choose_plan`` calls in Auto mode, for this pass's trace window
    (``records``; None when the trace could not be read, ``no_trace_why`` says why).
    ``same_host``: local mode's instances share one host (see ``profiler_proposal``).

    At least ``profiler.minRequests`` records: the bounded profiler, which also re-simulates
    the current plan. Otherwise, or when the cost model cannot be read or the search fails:
    the first plan is the heuristic's (its reason says why); a later re-plan raises
    PlanningError, so the current plan stays (no flapping between profiler and heuristic).
    """

    def plan(
        spec: EPDDeploymentSpec, stats: WorkloadStats | None, current: Plan | None
    ) -> Proposal:
        def cannot(why: str) -> Proposal:
            if current is not None:
                raise PlanningError(why)
            return Proposal(heuristic_plan(spec, stats, why))

        if records is None:
            return cannot(no_trace_why)
        need = spec.profiler.min_requests
        if len(records) < need:
            return cannot(f"{len(records)} requests in the trace window, profiler needs {need}")
        try:
            cost, label = cost_source()
            target = target_rate(spec, stats)
            return bounded_profiler_plan(
                spec, records, cost, label, timeout_s, max_requests, current, same_host, target
            )
        except (PlanningError, ValueError) as exc:
            return cannot(f"profiler gave no plan: {exc}")

    return plan
