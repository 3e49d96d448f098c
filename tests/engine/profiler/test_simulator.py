from __future__ import annotations

import dataclasses

import pytest

from epd_engine.config import SLO, Method, Role
from epd_engine.contracts.plan import Budgets, Plan
from epd_engine.profiler.cost_model import Overheads
from epd_engine.profiler.simulator import cpu_share, simulate
from epd_engine.slo.outcomes import summarize

from .factories import make_trace, toy_cost_model

PLANS = [
    Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 2, Role.D: 2}),
    Plan(method=Method.EP_D, pools={Role.EP: 2, Role.D: 1}),
    Plan(method=Method.ED_P, pools={Role.ED: 2, Role.P: 1}),
    Plan(method=Method.E_PD, pools={Role.E: 1, Role.PD: 2}),
    Plan(method=Method.EPD, pools={Role.EPD: 3}),
]
SLO_LOOSE = SLO(ttft_s=10.0, tpot_s=1.0)


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.describe())
def test_every_request_finishes_exactly_once_with_all_its_tokens(plan: Plan) -> None:
    trace = make_trace(num=60, rate_rps=50, output_tokens=7, text_only_every=3)
    result = simulate(plan, trace, toy_cost_model(), SLO_LOOSE)
    assert [r.request_id for r in result.results] == [t.request_id for t in trace]
    for record, r in zip(trace, result.results, strict=True):
        assert r.ok, r.error
        assert r.num_output_tokens == record.output_tokens
        assert len(r.itl_s) == record.output_tokens - 1
        assert r.e2e_s is not None and r.ttft_s is not None and r.e2e_s >= r.ttft_s > 0
    assert not result.stopped_early


def test_paths_follow_the_method_and_text_skips_encode() -> None:
    plan = Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 1, Role.D: 1})
    trace = make_trace(num=4, text_only_every=2)
    results = simulate(plan, trace, toy_cost_model(), SLO_LOOSE).results
    assert [r.path for r in results] == [("P", "D"), ("E", "P", "D")] * 2
    kv_move = 0.001 + 20 * 4096 / 1e9
    assert results[0].stage_s == {  # the router's names; the queue on D includes the pull
        "prefill_queue": 0.0,
        "prefill": pytest.approx(0.005 + 20 * 1e-4),
        "migration_kv": pytest.approx(kv_move),
        "decode_queue": pytest.approx(kv_move),
        "decode": pytest.approx(4 * (0.005 + 1e-4)),
    }
    assert results[1].stage_s is not None and set(results[1].stage_s) == {
        f"{stage}{suffix}" for stage in ("encode", "prefill", "decode") for suffix in ("", "_queue")
    } | {"migration_image", "migration_kv"}
    ed = Plan(method=Method.ED_P, pools={Role.ED: 1, Role.P: 1})
    paths = [r.path for r in simulate(ed, trace, toy_cost_model(), SLO_LOOSE).results]
    assert paths == [("P", "ED"), ("ED", "P", "ED")] * 2


def test_an_idle_plan_matches_the_cost_model_exactly() -> None:
    """One request alone: TTFT = encode + image migration + prefill; TPOT = decode step."""
    cost = toy_cost_model(encode_per_image_s=0.01, prefill_per_token_s=1e-4, decode_step_s=0.005)
    plan = Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 1, Role.D: 1})
    [r] = simulate(plan, make_trace(num=1, output_tokens=3), cost, SLO_LOOSE).results
    encode = 0.01
    image_move = cost.migration_s("image", 100)
    prefill = 0.005 + 1e-4 * 120
    assert r.ttft_s == pytest.approx(encode + image_move + prefill)
    kv_move = cost.migration_s("kv", 120)
    assert r.itl_s[0] == pytest.approx(kv_move + 0.005 + 1e-4)
    assert r.itl_s[1] == pytest.approx(0.005 + 1e-4)


@pytest.mark.parametrize("method", [Method.E_P_D, Method.EPD])
def test_cached_prompt_tokens_in_the_trace_are_not_prefilled(method: Method) -> None:
    """A record's ``cached_tokens`` (the prefix cache served them): prefill computes only
    the rest, so TTFT and the prefill instances' busy time shrink by their cost."""
    cost = toy_cost_model(encode_per_image_s=0.01, prefill_per_token_s=1e-4, decode_step_s=0.005)
    plan = Plan(method=method, pools=dict.fromkeys(method.roles, 1))
    [fresh] = make_trace(num=1, output_tokens=3)
    cached = fresh.model_copy(update={"cached_tokens": 96})
    [cold] = simulate(plan, [fresh], cost, SLO_LOOSE).results
    [warm] = simulate(plan, [cached], cost, SLO_LOOSE).results
    assert cold.ttft_s is not None and warm.ttft_s is not None
    assert cold.ttft_s - warm.ttft_s == pytest.approx(96 * 1e-4)
    everything = fresh.model_copy(update={"cached_tokens": 10_000})  # at least one computed
    [last] = simulate(plan, [everything], cost, SLO_LOOSE).results
    assert last.ok and last.ttft_s is not None
    assert cold.ttft_s - last.ttft_s == pytest.approx(119 * 1e-4)


def test_reports_the_same_summary_as_bench() -> None:
    plan = Plan(method=Method.EPD, pools={Role.EPD: 2})
    result = simulate(plan, make_trace(num=30), toy_cost_model(), SLO_LOOSE)
    summary = summarize(result.results, SLO_LOOSE)
    assert summary.num_ok == 30 and summary.attainment == 1.0
    assert summary.ttft.p90_s > 0 and summary.tpot_p90.p90_s > 0


def test_encoder_cache_hits_skip_encode() -> None:
    """A request whose every image E has cached goes on to P at once (it used to stay on E,
    unfinished: E ran no iteration for it, so nothing handed it on)."""
    plan = Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 1, Role.D: 1})
    cost = toy_cost_model(encode_per_image_s=0.2)
    fresh = simulate(plan, make_trace(num=10, rate_rps=2), cost, SLO_LOOSE)
    shared = simulate(plan, make_trace(num=10, rate_rps=2, shared_images=True), cost, SLO_LOOSE)
    assert all(r.ok for r in shared.results), [r.error for r in shared.results]
    assert [r.path for r in shared.results] == [("E", "P", "D")] * 10
    assert fresh.busy_s_by_role["E"] == pytest.approx(10 * 0.2)
    assert shared.busy_s_by_role["E"] == pytest.approx(0.2)  # encoded once, then cache hits


def test_overload_stops_early_and_counts_as_failing() -> None:
    plan = Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 1, Role.D: 1})
    cost = toy_cost_model(encode_per_image_s=0.5)  # E serves 2 img/s; the trace sends 100/s
    trace = make_trace(num=200, rate_rps=100)
    slo = SLO(ttft_s=1.0, tpot_s=1.0)
    result = simulate(plan, trace, cost, slo, stop_on_failure=True)
    assert result.stopped_early
    attainment = summarize(result.results, slo).attainment
    assert attainment is not None and attainment < 0.9
    assert any(r.error and "stopped early" in r.error for r in result.results)


def test_requests_that_cannot_fit_fail_clearly_instead_of_hanging() -> None:
    plan = Plan(method=Method.EPD, pools={Role.EPD: 1})
    trace = make_trace(num=2, prompt_tokens=5000)  # over the 4096-token context window
    results = simulate(plan, trace, toy_cost_model(), SLO_LOOSE).results
    assert all(r.error and "context window" in r.error for r in results)


def test_an_infeasible_budget_fails_every_request() -> None:
    plan = Plan(method=Method.EPD, pools={Role.EPD: 1})
    slo = SLO(ttft_s=1.0, tpot_s=0.001)  # no decode step is that fast
    results = simulate(plan, make_trace(num=3), toy_cost_model(), slo).results
    assert all(r.error and "budget" in r.error for r in results)


def test_given_budgets_are_used() -> None:
    plan = Plan(
        method=Method.EPD,
        pools={Role.EPD: 1},
        budgets={Role.EPD: Budgets(image_budget=1, token_budget=8)},
    )
    trace = make_trace(num=1, prompt_tokens=20, images_per_request=0)
    [r] = simulate(plan, trace, toy_cost_model(), SLO_LOOSE).results
    assert r.ttft_s == pytest.approx(3 * 0.005 + 20 * 1e-4)  # three chunks of <= 8 tokens


def test_instances_sharing_host_cores_slow_each_other_down() -> None:
    plan = Plan(method=Method.EPD, pools={Role.EPD: 2})
    trace = make_trace(num=2, rate_rps=1000, images_per_request=0, output_tokens=2)
    own = simulate(plan, trace, toy_cost_model(), SLO_LOOSE).results
    shared = simulate(plan, trace, toy_cost_model(), SLO_LOOSE, host_cores=1).results
    assert own[1].ttft_s is not None and shared[1].ttft_s is not None
    assert shared[1].ttft_s > own[1].ttft_s * 1.5  # both prefills ran at once on one core


def test_a_migration_is_hand_off_then_queue_then_pull_as_in_the_real_protocol() -> None:
    """Calibrated protocol latencies: the offer (hand-off) reaches the target's queue, the
    pull runs once the target admitted it; the queue the router reports includes the pull."""
    base = toy_cost_model(encode_per_image_s=0.01, prefill_per_token_s=1e-4, decode_step_s=0.005)
    cost = dataclasses.replace(base, overheads=Overheads(handoff_s=0.02, pull_s=0.03))
    plan = Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 1, Role.D: 1})
    [r] = simulate(plan, make_trace(num=1, output_tokens=3), cost, SLO_LOOSE).results
    image_pull = 0.03 + cost.migration_s("image", 100)
    kv_pull = 0.03 + cost.migration_s("kv", 120)
    prefill = 0.005 + 1e-4 * 120
    assert r.ttft_s == pytest.approx(0.01 + 0.02 + image_pull + prefill)
    assert r.itl_s[0] == pytest.approx(0.02 + kv_pull + 0.005 + 1e-4)
    assert r.stage_s is not None
    assert r.stage_s["migration_image"] == pytest.approx(image_pull)
    assert r.stage_s["prefill_queue"] == pytest.approx(image_pull)
    assert r.stage_s["decode_queue"] == pytest.approx(kv_pull)


def test_a_kv_pull_waits_its_own_calibrated_latency() -> None:
    """KV moves by the early hand-off: its target's wait (``kv_pull_s``) is not an image pull's."""
    base = toy_cost_model(encode_per_image_s=0.01, prefill_per_token_s=1e-4, decode_step_s=0.005)
    overheads = Overheads(handoff_s=0.02, pull_s=0.03, kv_pull_s=0.05)
    cost = dataclasses.replace(base, overheads=overheads)
    plan = Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 1, Role.D: 1})
    [r] = simulate(plan, make_trace(num=1, output_tokens=3), cost, SLO_LOOSE).results
    assert r.stage_s is not None
    assert r.stage_s["migration_image"] == pytest.approx(0.03 + cost.migration_s("image", 100))
    kv_pull = 0.05 + cost.migration_s("kv", 120)
    assert r.stage_s["decode_queue"] == pytest.approx(kv_pull)
    assert r.itl_s[0] == pytest.approx(0.02 + kv_pull + 0.005 + 1e-4)


def test_an_image_hop_waits_its_own_offer_latency_a_kv_hop_the_hand_off() -> None:
    """The image offer is calibrated apart (``image_handoff_s``, priced as its pull): an E+P+D
    TTFT holds it, not the KV hop's hand-off, which stays in the first gap."""
    base = toy_cost_model(encode_per_image_s=0.01, prefill_per_token_s=1e-4, decode_step_s=0.005)
    overheads = Overheads(handoff_s=0.02, pull_s=0.03, image_handoff_s=0.004)
    cost = dataclasses.replace(base, overheads=overheads)
    plan = Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 1, Role.D: 1})
    [r] = simulate(plan, make_trace(num=1, output_tokens=3), cost, SLO_LOOSE).results
    image_pull = 0.03 + cost.migration_s("image", 100)
    kv_pull = 0.03 + cost.migration_s("kv", 120)
    assert r.ttft_s == pytest.approx(0.01 + 0.004 + image_pull + 0.005 + 1e-4 * 120)
    assert r.itl_s[0] == pytest.approx(0.02 + kv_pull + 0.005 + 1e-4)


def test_a_target_without_pages_keeps_the_migration_queued_until_it_has_room() -> None:
    """Pages are taken when the target's scheduler admits the pull, not when the offer lands:
    with room for one request's KV on D, the second waits in D's queue, nothing fails."""
    cost = dataclasses.replace(
        toy_cost_model(),
        capacity=dataclasses.replace(toy_cost_model().capacity, num_kv_blocks=3),
    )
    plan = Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 1, Role.D: 1})
    trace = make_trace(num=2, rate_rps=1000, images_per_request=0, output_tokens=20)
    first, second = simulate(plan, trace, cost, SLO_LOOSE).results
    assert first.ok and second.ok
    assert first.e2e_s is not None and second.ttft_s is not None
    second_decodes_from = second.arrival_s + second.ttft_s + second.itl_s[0]
    assert second_decodes_from > first.arrival_s + first.e2e_s  # waited for the first's pages


def test_request_overhead_does_not_scale_with_processes_per_core() -> None:
    e_p_d = Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 1, Role.D: 1})
    epd = Plan(method=Method.EPD, pools={Role.EPD: 1})
    assert cpu_share(e_p_d, None) == 1.0  # own devices
    assert cpu_share(e_p_d, 2) == 2.0  # three instances and the router on two cores
    assert cpu_share(epd, 2) == 1.0 and cpu_share(epd, 8) == 1.0
    cost = dataclasses.replace(toy_cost_model(), overheads=Overheads(request_s=0.1))
    trace = make_trace(num=1, images_per_request=0, output_tokens=2)
    [own] = simulate(e_p_d, trace, cost, SLO_LOOSE).results
    [shared] = simulate(e_p_d, trace, cost, SLO_LOOSE, host_cores=2).results
    assert own.ttft_s is not None and shared.ttft_s is not None
    # the router and HTTP are the same processes in every plan: not 0.2 s on a shared host
    assert shared.ttft_s == pytest.approx(own.ttft_s)


def test_colocated_stages_report_queue_and_execution_like_the_engine() -> None:
    plan = Plan(method=Method.EPD, pools={Role.EPD: 1})
    [r] = simulate(plan, make_trace(num=1, output_tokens=4), toy_cost_model(), SLO_LOOSE).results
    assert r.stage_s == {
        "encode_queue": 0.0,
        "encode": pytest.approx(0.01),
        "prefill_queue": 0.0,
        "prefill": pytest.approx(0.005 + 1e-4 * 120),
        "decode_queue": 0.0,
        "decode": pytest.approx(3 * (0.005 + 1e-4)),
    }


def test_encode_and_kv_export_iterations_cost_their_calibrated_overheads() -> None:
    """An encode iteration pays ``encode_s``; a prefill pays ``export_s`` only where nothing
    decodes (its KV is offered early and exported layer by layer), not on an EPD instance."""
    base = toy_cost_model()
    cost = dataclasses.replace(base, overheads=Overheads(encode_s=0.003, export_s=0.002))
    trace = make_trace(num=1, output_tokens=2)
    for plan, export in (
        (Plan(method=Method.EPD, pools={Role.EPD: 1}), 0.0),
        (Plan(method=Method.EP_D, pools={Role.EP: 1, Role.D: 1}), 0.002),
    ):
        [plain] = simulate(plan, trace, base, SLO_LOOSE).results
        [charged] = simulate(plan, trace, cost, SLO_LOOSE).results
        assert plain.stage_s is not None and charged.stage_s is not None
        assert charged.stage_s["encode"] == pytest.approx(plain.stage_s["encode"] + 0.003)
        assert charged.stage_s["prefill"] == pytest.approx(plain.stage_s["prefill"] + export)
        assert charged.ttft_s == pytest.approx((plain.ttft_s or 0.0) + 0.003 + export)


def test_tokens_the_client_gets_no_text_for_fold_into_the_next_gap() -> None:
    """As the client measures: one gap a chunk, the last token flushes what was held."""
    plan = Plan(method=Method.EPD, pools={Role.EPD: 1})
    trace = make_trace(num=1, images_per_request=0, output_tokens=5)
    base = toy_cost_model()
    silent = dataclasses.replace(base, overheads=Overheads(silent_tokens=1.0))
    [plain] = simulate(plan, trace, base, SLO_LOOSE).results
    [folded] = simulate(plan, trace, silent, SLO_LOOSE).results
    assert len(plain.itl_s) == 4 and len(folded.itl_s) == 1
    assert folded.itl_s[0] == pytest.approx(sum(plain.itl_s))
    assert folded.num_output_tokens == plain.num_output_tokens == 5
    assert folded.e2e_s == pytest.approx(plain.e2e_s)


def test_front_work_queues_behind_the_previous_request_on_a_shared_host() -> None:
    """Router, HTTP and preprocessing of requests that arrive together run one after the
    other on a shared host (measured: 4-7 ms longer TTFT after a close predecessor)."""
    plan = Plan(method=Method.EPD, pools={Role.EPD: 2})
    cost = dataclasses.replace(toy_cost_model(), overheads=Overheads(request_s=0.1))
    trace = make_trace(num=2, rate_rps=1e6, images_per_request=0, output_tokens=2)
    own = simulate(plan, trace, cost, SLO_LOOSE).results
    shared = simulate(plan, trace, cost, SLO_LOOSE, host_cores=8).results
    assert own[1].ttft_s == pytest.approx(own[0].ttft_s, abs=1e-3)  # two instances, in parallel
    assert shared[1].ttft_s == pytest.approx((shared[0].ttft_s or 0.0) + 0.1, abs=1e-3)
