"""A request's front on a shared host: CPU contention with the iterations running meanwhile,
and the entry instance's own iterations slowed while its process preprocesses."""

from __future__ import annotations

import dataclasses
from statistics import median

import pytest

from epd_engine.config import SLO, Method, Role
from epd_engine.contracts.plan import Plan
from epd_engine.contracts.trace import TraceRecord
from epd_engine.profiler.cost_model import FittedCostModel, Overheads
from epd_engine.profiler.simulator import simulate

from .factories import toy_cost_model

SLO_LOOSE = SLO(ttft_s=10.0, tpot_s=1.0)
FRONT_S = 0.02
STEP_S = 0.005 + 1e-4  # the toy model's decode step for one request


def _cost(contention: float) -> FittedCostModel:
    overheads = Overheads(request_s=FRONT_S, front_contention=contention)
    return dataclasses.replace(toy_cost_model(), overheads=overheads)


def _long_decode_then_a_newcomer(arrival_s: float = 0.1) -> list[TraceRecord]:
    """A text request decoding for ~0.5 s, and a second arriving while it decodes."""
    return [
        TraceRecord(request_id="long", arrival_s=0.0, prompt_tokens=20, output_tokens=100),
        TraceRecord(request_id="new", arrival_s=arrival_s, prompt_tokens=20, output_tokens=2),
    ]


def test_iterations_in_the_fronts_own_process_run_at_half_speed() -> None:
    """EPD: the newcomer's preprocessing shares the decoding instance's process, so the gaps
    it overlaps double (measured in EPD: 2.1 ms in-front gaps against 1.0 without); with
    own devices, or with the decode in another process, they do not."""
    epd = Plan(method=Method.EPD, pools={Role.EPD: 1})
    ep_d = Plan(method=Method.EP_D, pools={Role.EP: 1, Role.D: 1})
    trace = _long_decode_then_a_newcomer()
    cost = _cost(contention=0.0)
    shared, _ = simulate(epd, trace, cost, SLO_LOOSE, host_cores=8).results
    own, _ = simulate(epd, trace, cost, SLO_LOOSE).results
    apart, _ = simulate(ep_d, trace, cost, SLO_LOOSE, host_cores=8).results
    assert max(own.itl_s) < 1.5 * STEP_S and max(apart.itl_s) < 1.5 * STEP_S
    doubled = [gap for gap in shared.itl_s if gap > 1.5 * STEP_S]
    assert doubled and max(doubled) == pytest.approx(2 * STEP_S, rel=0.05)
    # the long request runs at half speed for the front's length: it loses half of that
    assert (shared.e2e_s or 0.0) - (own.e2e_s or 0.0) == pytest.approx(FRONT_S / 2, abs=STEP_S)
    assert median(shared.itl_s) == pytest.approx(median(own.itl_s), rel=0.05)


def test_a_front_stretches_by_the_calibrated_share_of_the_hosts_iterations() -> None:
    """EP+D: the newcomer's front runs on EP while D decodes back to back; at contention c
    it grows by c of every second it overlaps, so by ``FRONT_S * c / (1 - c)`` in all."""
    plan = Plan(method=Method.EP_D, pools={Role.EP: 1, Role.D: 1})
    trace = _long_decode_then_a_newcomer()
    _, plain = simulate(plan, trace, _cost(0.0), SLO_LOOSE, host_cores=8).results
    _, slowed = simulate(plan, trace, _cost(0.5), SLO_LOOSE, host_cores=8).results
    assert plain.ttft_s is not None and slowed.ttft_s is not None
    assert slowed.ttft_s - plain.ttft_s == pytest.approx(FRONT_S, abs=STEP_S)
    # with own devices (GPU pods) the fronts compete with nothing
    _, own_plain = simulate(plan, trace, _cost(0.0), SLO_LOOSE).results
    _, own_slowed = simulate(plan, trace, _cost(0.5), SLO_LOOSE).results
    assert own_slowed.ttft_s == pytest.approx(own_plain.ttft_s)


def test_an_idle_host_leaves_the_front_as_drawn() -> None:
    plan = Plan(method=Method.EP_D, pools={Role.EP: 1, Role.D: 1})
    trace = _long_decode_then_a_newcomer(arrival_s=5.0)  # the long one has finished
    _, plain = simulate(plan, trace, _cost(0.0), SLO_LOOSE, host_cores=8).results
    _, slowed = simulate(plan, trace, _cost(0.5), SLO_LOOSE, host_cores=8).results
    assert slowed.ttft_s == pytest.approx(plain.ttft_s)
