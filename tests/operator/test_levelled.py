"""An elastic plan is sized on the window at a level rate (``planning/levelled.py``): after a
drop, the burst that is over is not sized for a second time through the window's shape."""

from __future__ import annotations

import random

import pytest

from epd_engine.contracts.trace import TraceRecord
from epd_engine.profiler.reference import reference_cost_model
from epd_engine.workload.arrivals import ArrivalSpec
from epd_engine.workload.generators import synthesize
from epd_operator.api.spec import EPDDeploymentSpec
from epd_operator.planning.forecast import forecast_window, num_bins
from epd_operator.planning.levelled import levelled
from epd_operator.planning.planner import profiler_proposal
from tests.operator.conftest import make_spec_dict

SPAN_S = 60.0


def drop(high_rps: float, high_s: float, low_rps: float, seed: int = 0) -> list[TraceRecord]:
    """textvqa requests, Poisson at ``high_rps`` for ``high_s``, then at ``low_rps``."""
    rng, t, arrivals = random.Random(seed), 0.0, []
    while (t := t + rng.expovariate(high_rps if t < high_s else low_rps)) < SPAN_S:
        arrivals.append(t)
    records = synthesize("textvqa", len(arrivals), ArrivalSpec("poisson", 5.0), seed=seed)
    return [r.model_copy(update={"arrival_s": a}) for r, a in zip(records, arrivals, strict=True)]


def test_levelled_keeps_the_requests_order_and_span_at_the_mean_rate() -> None:
    records = drop(60.0, 8.0, 3.0)
    got = levelled(records)
    assert [r.request_id for r in got] == [r.request_id for r in records]
    assert [r.prompt_tokens for r in got] == [r.prompt_tokens for r in records]
    assert got[0].arrival_s == records[0].arrival_s
    assert got[-1].arrival_s == pytest.approx(records[-1].arrival_s)
    # each sub-window's requests now take as long as they would at the window's mean rate
    start, span = records[0].arrival_s, records[-1].arrival_s - records[0].arrival_s
    bins = num_bins(len(records))
    index = [min(bins - 1, int((r.arrival_s - start) / (span / bins))) for r in records]
    per_request = span / len(records)
    done = 0
    for k in range(bins):
        mine = [g.arrival_s - start for g, i in zip(got, index, strict=True) if i == k]
        assert done * per_request - 1e-9 <= min(mine)
        assert max(mine) <= (done + len(mine)) * per_request + 1e-9
        done += len(mine)
    assert sorted(index) == index and len(set(index)) == bins == 6
    assert levelled([]) == [] and levelled(records[:1]) == records[:1]


def test_after_a_drop_one_instance_is_sized_for_the_rate_one_serves() -> None:
    """60 rps for 8 s, then 3 rps: the forecast (the stabilisation window's peak) is about
    4 rps, which one instance of the reference model serves (13.9 rps on textvqa). Replayed
    at that rate with its shape, the burst still ran at over 15 rps and the loop sized two
    (a real-engine run went 3 -> 1 -> 2 at a flat 0.4 rps)."""
    spec = EPDDeploymentSpec.model_validate(
        make_spec_dict(
            disaggregation={"mode": "Auto"},
            capacity={"minGPUs": 1, "maxGPUs": 8, "scaleDownStabilizationSeconds": 20},
        )
    )
    records = drop(60.0, 8.0, 3.0)
    forecast = forecast_window([r.arrival_s for r in records], SPAN_S, 10.0, 20.0)
    assert forecast.forecast_rps < 5.0 < forecast.seen_rps
    target = forecast.forecast_rps * 1.2
    proposal = profiler_proposal(
        spec, records, reference_cost_model(), max_requests=200, target_rps=target
    )
    plan = proposal.plan
    assert plan.num_instances == 1, plan.reason
    assert plan.predicted is not None and plan.predicted.goodput_rps >= target
    assert "at a level rate" in plan.reason
