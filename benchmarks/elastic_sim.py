"""Part 2 of ``bench_elastic``: the same day for a large fleet through the planner alone (the
simulator, no processes), at H200 speed. The day is cut into ``windows`` equal windows; each
is planned on the window before (what the loop's trace window holds), sized for the forecast
(Theil-Sen over the last three windows, never below the last) times the headroom and decided
as the loop decides (``choose_plan``: at the same size a plan must beat the current one by
the switch margin), then the window's own requests are simulated on that plan. Transitions
between plans are not simulated."""

from __future__ import annotations

import itertools
import time
from typing import Any

from benchmarks.elastic_trace import TEXT_OUTPUT_TOKENS, Day, arrivals, record
from epd_engine.config import SLO
from epd_engine.contracts.plan import Plan
from epd_engine.contracts.trace import TraceRecord
from epd_engine.profiler.evaluate import Evaluator
from epd_engine.profiler.simulator import Simulator
from epd_engine.slo.attainment import attainment
from epd_operator.api.spec import EPDDeploymentSpec, PlanStatus
from epd_operator.planning.choice import Proposal, WorkloadStats, choose_plan
from epd_operator.planning.forecast import forecast_rates
from epd_operator.planning.planner import candidate_of, cost_model_from_json, profiler_proposal

HOURS = 24.0
REQUESTS_PER_WINDOW = 300  # each window's sample (its rate and mix; the planner samples too)
HEADROOM = 0.2
PER_GPU_PEAK_RPS = 44.0  # the day's peak per GPU of the fleet (H200, 80 % images: ~58 max)


def window_records(day: Day, k: int, windows: int, seed: int) -> tuple[list[TraceRecord], float]:
    """``REQUESTS_PER_WINDOW`` requests at window ``k``'s mid rate and image share."""
    mid = (k % windows + 0.5) * day.length_s / windows
    rate, share = day.rate_rps(mid), day.image_share(mid)
    flat = Day(REQUESTS_PER_WINDOW / rate, rate, 1.0, share, share, day.image_output_tokens)
    return [record(a, 576) for a in arrivals(flat, seed + k)], rate


def spec_for(gpus: int, slo: SLO) -> EPDDeploymentSpec:
    return EPDDeploymentSpec.model_validate(
        {
            "model": {"name": "llava-1.5-7b", "source": {"preset": "tiny-llava"}},
            "gpuBudget": gpus,
            "capacity": {"minGPUs": 1, "maxGPUs": gpus},
            "slo": {
                "ttftMilliseconds": round(slo.ttft_s * 1000),
                "tpotMilliseconds": round(slo.tpot_s * 1000),
            },
            "disaggregation": {"mode": "Auto"},
        }
    )


def decided(spec: EPDDeploymentSpec, current: Plan | None, proposal: Proposal, n: int) -> Plan:
    """What the loop runs after ``proposal``: its own ``choose_plan`` (the switch margin at
    the same size; a window apart, so no cooldown or stabilisation holds it back)."""
    if current is None:
        return proposal.plan
    stats = WorkloadStats(num_requests=max(n, spec.profiler.min_requests), request_rate_rps=0.0)
    return choose_plan(
        spec,
        PlanStatus.from_plan(current, 1),
        stats,
        planned_on=None,
        seconds_since_plan=float("inf"),
        planner=lambda *_: proposal,
    ).plan


def simulate_day(
    gpus: int,
    cost_json: str,
    ttft_s: float,
    tpot_s: float,
    seed: int = 0,
    windows: int = 24,
    night_rps: float | None = None,
    image_output_tokens: int = TEXT_OUTPUT_TOKENS,
) -> dict[str, Any]:
    """``night_rps``: the lowest rate (default: the fleet's share of ``PER_GPU_PEAK_RPS``).
    ``image_output_tokens``: an image request's answer (default: as long as a text one's;
    with the emulated fleet's 8-token answers a 256-GPU search takes 20-60 s per size, as
    EP+D's TPOT sits at the SLO and the bound prunes little)."""
    cost = cost_model_from_json(cost_json, "H200")
    slo = SLO(ttft_s=ttft_s, tpot_s=tpot_s)
    night = night_rps or gpus * PER_GPU_PEAK_RPS / 8
    day = Day(HOURS, night, image_output_tokens=image_output_tokens)
    spec = spec_for(gpus, slo)
    rows: list[dict[str, Any]] = []
    previous, rate = window_records(day, windows - 1, windows, seed)  # the day before's last
    rates = [rate]
    plan: Plan | None = None
    started = time.perf_counter()
    for k in range(windows):
        records, rate = window_records(day, k, windows, seed)
        f = forecast_rates(rates[-3:], 1.0, rates[-1], 1.0, 1.0)
        t = time.perf_counter()
        target = f.forecast_rps * (1 + HEADROOM)
        # the emulated fleet's link (its pools share one host): transfer partners placed
        # together, as a GPU cluster's group pods place them
        proposal = profiler_proposal(
            spec, previous, cost, "H200", current=plan, same_host=True, target_rps=target
        )
        plan = decided(spec, plan, proposal, len(previous))
        search_s = time.perf_counter() - t
        # the whole window (the search's own simulations stop once the SLO is lost)
        budgeted = Evaluator(records, cost, slo).plan(candidate_of(plan))
        share = attainment(Simulator(budgeted, cost, slo).run(records).results, slo)
        predicted = plan.predicted.goodput_rps if plan.predicted else None
        rows.append(
            {
                "window": k,
                "rate_rps": round(rate, 1),
                "image_share": round(day.image_share((k + 0.5) * HOURS / windows), 2),
                "forecast_rps": round(f.forecast_rps, 1),
                "plan": plan.describe(),
                "gpus": plan.num_instances,
                "predicted_goodput_rps": None if predicted is None else round(predicted, 1),
                "attainment": round(share, 4),
                "search_s": round(search_s, 1),
            }
        )
        print(f"  simulated window {k}: {rows[-1]}", flush=True)
        previous = records
        rates.append(rate)
    used = sum(r["gpus"] for r in rows)
    methods = [r["plan"].split(" ")[0] for r in rows]
    return {
        "note": "SIMULATED: planner + simulator, H200 cost model (not slowed), no processes",
        "gpus": gpus,
        "windows": windows,
        "night_rps": day.night_rps,
        "answer_tokens": {"text": TEXT_OUTPUT_TOKENS, "image": image_output_tokens},
        "peak_rps": day.peak_rps,
        "requests_per_window_sampled": REQUESTS_PER_WINDOW,
        "summary": {
            "gpu_hours_vs_static": round(used / (gpus * windows), 3),
            "attainment_rate_weighted": round(
                sum(r["rate_rps"] * r["attainment"] for r in rows)
                / sum(r["rate_rps"] for r in rows),
                4,
            ),
            "windows_below_95": sum(r["attainment"] < 0.95 for r in rows),
            "method_changes": sum(a != b for a, b in itertools.pairwise(methods)),
            "planner_s": round(time.perf_counter() - started, 1),
        },
        "windows_detail": rows,
    }
