from __future__ import annotations

import dataclasses
import math
import random

import pytest

from epd_engine.config import SLO, Method, Role
from epd_engine.contracts.plan import Plan
from epd_engine.profiler.calibrate import calibrate, quantiles, unfold_silent
from epd_engine.profiler.cost_model import BatchShape, Overheads
from epd_engine.profiler.jitter import Jitter
from epd_engine.profiler.simulator import simulate
from epd_engine.slo.outcomes import RequestResult

from .factories import make_trace, toy_cost_model


def _result(i: int, ttft_s: float, gaps: tuple[float, ...]) -> RequestResult:
    return RequestResult(
        request_id=f"r{i}",
        arrival_s=float(i),
        prompt_tokens=20,
        num_images=0,
        output_tokens=len(gaps) + 1,
        ttft_s=ttft_s,
        itl_s=gaps,
        e2e_s=ttft_s + sum(gaps),
        num_output_tokens=len(gaps) + 1,
        stage_s={"prefill_queue": 0.01, "prefill": 0.04, "decode": sum(gaps)},
    )


def test_calibration_recovers_request_and_step_overheads() -> None:
    cost = toy_cost_model(decode_step_s=0.005)
    step = cost.decode_s(1, 22)
    results = [_result(i, 0.15, (step + 0.01,) * 4) for i in range(10)]
    calibrated = calibrate(cost, results, source="unit")
    assert calibrated.overheads.request_s == pytest.approx(0.1)  # 0.15 - 0.01 - 0.04
    assert calibrated.overheads.step_s == pytest.approx(0.01, abs=1e-4)
    assert calibrated.meta["calibration"]["num_requests"] == 9  # the first sent is cold
    assert all(q == pytest.approx(0.01, abs=1e-4) for q in calibrated.overheads.step_s_quantiles)


def test_calibrated_overheads_show_up_in_simulated_latency() -> None:
    cost = toy_cost_model()
    step = cost.decode_s(1, 22)
    calibrated = calibrate(cost, [_result(i, 0.15, (step + 0.01,) * 4) for i in range(10)])
    plan = Plan(method=Method.EPD, pools={Role.EPD: 1})
    trace = make_trace(num=1, images_per_request=0, output_tokens=3)
    slo = SLO(ttft_s=10, tpot_s=1)
    [plain] = simulate(plan, trace, cost, slo).results
    [slowed] = simulate(plan, trace, calibrated, slo).results
    assert slowed.ttft_s is not None and plain.ttft_s is not None
    assert slowed.ttft_s == pytest.approx(plain.ttft_s + 0.1 + 0.01, abs=1e-3)
    assert slowed.itl_s[0] == pytest.approx(plain.itl_s[0] + 0.01, abs=1e-3)


def test_the_first_request_sent_does_not_calibrate() -> None:
    """It pays one-off costs (first kernels, first connections) that no other request does."""
    cost = toy_cost_model(decode_step_s=0.005)
    step = cost.decode_s(1, 22)
    cold = _result(0, 5.0, (step + 0.01,) * 4)
    warm = [_result(i, 0.15, (step + 0.01,) * 4) for i in range(1, 4)]
    o = calibrate(cost, [cold, *warm]).overheads
    assert o.request_s == pytest.approx(0.1)
    assert max(o.request_s_quantiles) == pytest.approx(0.1)


def test_calibration_needs_stage_timings() -> None:
    bare = RequestResult(request_id="x", arrival_s=0.0, ttft_s=0.1, itl_s=(0.01,))
    with pytest.raises(ValueError, match="stage_s"):
        calibrate(toy_cost_model(), [bare])


def test_quantiles_are_evenly_spaced_midpoints() -> None:
    assert quantiles([]) == ()
    assert quantiles([float(i) for i in range(100)], num=4) == (12.0, 37.0, 62.0, 87.0)


def _disaggregated(
    i: int,
    request_s: float = 0.1,
    handoff_s: float = 0.02,
    pull_s: float = 0.03,
    step_s: float = 0.006,
    path: tuple[str, ...] = ("e", "p", "d"),
    image_offer_s: float = 0.029,
) -> RequestResult:
    """An E+P+D request as our router reports it: the queues after a hop include the pull;
    TTFT holds the image offer (``image_offer_s``: as the pull's protocol, 0.03 s minus the
    toy link's 1 ms); the first gap spans the KV hop (hand-off, D's queue, one decode step)."""
    encode, prefill, decode_wait = 0.005, 0.01, 0.004
    stages = {
        "encode_queue": 0.0,
        "encode": encode,
        "migration_image": pull_s,
        "prefill_queue": pull_s + 0.002,
        "prefill": prefill,
        "migration_kv": pull_s,
        "decode_queue": pull_s + decode_wait,
        "decode": 4 * step_s,
    }
    ttft = request_s + encode + image_offer_s + stages["prefill_queue"] + prefill
    gaps = (handoff_s + stages["decode_queue"] + step_s,) + (step_s,) * 3
    return RequestResult(
        request_id=f"r{i}",
        arrival_s=float(i),
        prompt_tokens=20,
        num_images=1,
        output_tokens=5,
        ttft_s=ttft,
        itl_s=gaps,
        e2e_s=ttft + sum(gaps),
        num_output_tokens=5,
        stage_s=stages,
        path=path,
    )


def test_calibration_separates_hand_off_pull_and_request_overheads() -> None:
    cost = toy_cost_model(decode_step_s=0.005)
    calibrated = calibrate(cost, [_disaggregated(i) for i in range(10)])
    o = calibrated.overheads
    assert o.handoff_s == pytest.approx(0.02, abs=1e-6)
    assert o.pull_s == pytest.approx(0.03 - 0.001, abs=2e-4)  # minus the link (1 ms + bytes)
    assert o.request_s == pytest.approx(0.1, abs=1e-6)  # image pull not counted twice
    step = 0.006 - cost.decode_s(1, 22)
    assert o.step_s == pytest.approx(step, abs=1e-6)
    # the first gap (the KV hop) is not engine-loop jitter
    assert max(o.step_s_quantiles) == pytest.approx(step, abs=1e-6)


def test_an_image_offer_is_priced_as_its_pull_not_as_the_kv_hand_off() -> None:
    """TTFT holds an image hop's offer together with the request overhead. The KV hop's
    hand-off (its first gap's rest, 4.7 ms on 2 cores) is the early offer's race and D's token
    relay; taken off as the image offer, it left EPD and EP+D 4.7 ms short (issue 19)."""
    cost = toy_cost_model(decode_step_s=0.005)
    results = [_disaggregated(i, handoff_s=0.05, pull_s=0.01, image_offer_s=0.009)
               for i in range(10)]  # fmt: skip
    o = calibrate(cost, results, cpu_share=2.0).overheads
    assert o.request_s == pytest.approx(0.1, abs=1e-6)  # not 0.1 + 0.009 - 0.05
    assert o.image_handoff_s == pytest.approx(0.009 / 2, abs=1e-6)  # per share, as the pull
    assert o.image_handoff_s_quantiles == o.pull_s_quantiles
    assert o.handoff_s == pytest.approx(0.05 / 2, abs=1e-6)  # the KV hop keeps its own


def test_a_kv_pull_is_read_off_the_decode_queue_not_the_last_copy() -> None:
    """The router's migration_kv times the last copy of an early hand-off; the target's wait
    for the source's prefill is in its decode queue (the decode instance idle at low rate)."""
    cost = toy_cost_model(decode_step_s=0.005)
    o = calibrate(cost, [_disaggregated(i) for i in range(10)]).overheads
    link = cost.migration_s("kv", 20)
    assert o.kv_pull_s == pytest.approx(0.03 + 0.004 - link, abs=1e-6)  # pull + D's wait
    assert o.pull_s == pytest.approx(0.03 - cost.migration_s("image", 0), abs=1e-6)


def test_overheads_are_stored_per_unit_of_cpu_share() -> None:
    cost = toy_cost_model(decode_step_s=0.005)
    results = [_disaggregated(i) for i in range(10)]
    plain = calibrate(cost, results).overheads
    shared = calibrate(cost, results, cpu_share=2.0).overheads
    # the router, HTTP and preprocessing are the same processes in every plan: as measured
    assert shared.request_s == pytest.approx(plain.request_s)
    assert shared.request_s_quantiles == plain.request_s_quantiles
    assert shared.pull_s == pytest.approx(plain.pull_s / 2)
    assert shared.handoff_s_quantiles == tuple(
        pytest.approx(q / 2, abs=1e-6) for q in plain.handoff_s_quantiles
    )
    # so is the engine loop's per-iteration overhead
    assert shared.step_s == pytest.approx(plain.step_s)
    assert shared.step_s_quantiles == plain.step_s_quantiles
    with pytest.raises(ValueError, match="cpu_share"):
        calibrate(cost, results, cpu_share=0.5)


def test_rerouted_requests_do_not_skew_the_hop_estimates() -> None:
    cost = toy_cost_model(decode_step_s=0.005)
    clean = [_disaggregated(i) for i in range(9)]
    rerouted = [_disaggregated(9 + i, request_s=5.0, handoff_s=3.0, path=("e", "p", "d", "p", "d"))
                for i in range(8)]  # fmt: skip
    calibrated = calibrate(cost, clean + rerouted)
    assert calibrated.overheads.request_s == pytest.approx(0.1, abs=1e-6)
    assert calibrated.overheads.handoff_s == pytest.approx(0.02, abs=1e-6)
    assert calibrated.meta["calibration"]["num_rerouted_skipped"] == 8


def test_calibrated_migration_overheads_show_up_in_simulated_latency() -> None:
    cost = toy_cost_model(decode_step_s=0.005)
    calibrated = calibrate(cost, [_disaggregated(i) for i in range(10)])
    plan = Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 1, Role.D: 1})
    trace = make_trace(num=1, output_tokens=3)
    slo = SLO(ttft_s=10, tpot_s=1)
    [plain] = simulate(plan, trace, cost, slo).results
    [slowed] = simulate(plan, trace, calibrated, slo).results
    assert slowed.ttft_s is not None and plain.ttft_s is not None
    o = calibrated.overheads
    extra = o.request_s_quantiles[0] + o.handoff_s_quantiles[0] + o.pull_s_quantiles[0]
    assert slowed.ttft_s > plain.ttft_s + extra - 1e-3  # every draw is the same here
    assert slowed.itl_s[0] > plain.itl_s[0] + o.handoff_s + o.pull_s - 1e-3


def test_jitter_scales_the_migration_overheads_by_the_plans_share() -> None:
    o = Overheads(request_s=0.01, step_s=0.002, handoff_s=0.003, pull_s=0.004)
    shared, alone = Jitter(o, cpu_share=2.0), Jitter(o, cpu_share=1.0)
    assert shared.request_s() == pytest.approx(alone.request_s())
    assert shared.handoff_s() == pytest.approx(2 * alone.handoff_s())
    assert shared.pull_s() == pytest.approx(2 * alone.pull_s())
    # an image offer: its own when calibrated, else (older models) the KV hop's hand-off
    assert alone.image_handoff_s() == pytest.approx(0.003)
    own = Jitter(dataclasses.replace(o, image_handoff_s=0.0005), cpu_share=2.0)
    assert own.image_handoff_s() == pytest.approx(0.001)
    assert shared.step_s() == pytest.approx(alone.step_s()) == pytest.approx(0.002)
    drawn = Overheads(step_s_quantiles=(0.001, 0.001, 0.005))
    assert {Jitter(drawn, seed, cpu_share=1.0).step_s() for seed in range(20)} == {0.001, 0.005}
    # nor is a stall (far above the median): the relay waiting, the same in every plan
    draws = {round(Jitter(drawn, seed, cpu_share=2.0).step_s(), 9) for seed in range(20)}
    assert draws == {0.001, 0.005}


def test_stalls_are_stored_as_measured_not_per_cpu_share() -> None:
    """Over 200 requests a rate on 2 cores the gaps' p98 is 3.7-4.5 ms in E+P+D (share 2),
    EP+D (1.5) and EPD (1) alike; stored per share, EPD's were halved (p90 TPOT -23..-35%)."""
    cost = toy_cost_model(decode_step_s=0.005)
    step = cost.decode_s(1, 22)
    gaps = (step,) * 8 + (step + 0.004,) * 2  # two 4 ms stalls in ten gaps
    results = [_result(i, 0.15, gaps) for i in range(10)]
    plain = calibrate(cost, results).overheads.step_s_quantiles
    shared = calibrate(cost, results, cpu_share=2.0).overheads.step_s_quantiles
    assert max(plain) == pytest.approx(0.004, abs=1e-6)
    assert shared == plain


def test_calibration_counts_tokens_the_client_got_no_chunk_for() -> None:
    cost = toy_cost_model(decode_step_s=0.005)
    r = _result(1, 0.15, (0.01, 0.01))
    silent = dataclasses.replace(r, num_output_tokens=5, output_tokens=5)  # 4 later, 2 chunks
    assert calibrate(cost, [r, r, silent]).overheads.silent_tokens == pytest.approx(0.5 * 4 / 6)


def test_calibration_reads_encode_and_kv_export_overheads_off_their_stages() -> None:
    cost = toy_cost_model(encode_per_image_s=0.002, decode_step_s=0.005, tokens_per_image=100)
    plain = calibrate(cost, [_disaggregated(i) for i in range(10)]).overheads
    slower = []
    for i in range(10):
        r = _disaggregated(i)
        stages = dict(r.stage_s or {})
        stages["encode"] += 0.003
        stages["prefill"] += 0.002
        slower.append(dataclasses.replace(r, stage_s=stages))
    o = calibrate(cost, slower).overheads
    assert o.encode_s == pytest.approx(plain.encode_s + 0.003, abs=1e-9)
    assert o.export_s == pytest.approx(plain.export_s + 0.002, abs=1e-9)
    # the runner's own step (2 ms) and the engine loop's step_s are not counted again
    assert cost.runner_step_s(BatchShape(num_images=1, image_tokens=100)) == pytest.approx(0.002)
    assert plain.encode_s == pytest.approx(0.005 - 0.002 - o.step_s)


def test_step_quantiles_resolve_a_one_percent_stall_tail() -> None:
    """p90 TPOT is made of the rare stalls: 2 gaps in 200 must be drawable."""
    cost = toy_cost_model(decode_step_s=0.005)
    step = cost.decode_s(1, 22)
    results = [_result(i, 0.15, (step,) * 20) for i in range(11)]  # the first is skipped
    results[-1] = _result(10, 0.15, (step,) * 18 + (step + 0.01,) * 2)
    quantiles_ = calibrate(cost, results).overheads.step_s_quantiles
    assert max(quantiles_) == pytest.approx(0.01, abs=1e-6)


def _fold(token: tuple[float, ...], silent: float, step_s: float, num: int = 20000) -> list[float]:
    """Chunk gaps' overheads as the client sees them: a silent token's gap runs on."""
    rng = random.Random(7)
    out = []
    for _ in range(num):
        value = rng.choice(token)
        while rng.random() < silent:
            value += step_s + rng.choice(token)
        out.append(value)
    return out


def test_unfolding_silent_tokens_inverts_the_clients_folding() -> None:
    # a loop body with a stall tail, like the measured one (p98 ~ 6x the median)
    token = tuple(0.0003 * -math.log(1 - (i + 0.5) / 128) for i in range(128))
    chunk = quantiles(_fold(token, 0.15, 0.0004), 128)
    assert unfold_silent(chunk, 0.0, 0.0004) == chunk
    unfolded = unfold_silent(chunk, 0.15, 0.0004)
    assert sum(chunk) > 1.3 * sum(token)  # what drawing the chunks' gaps did
    assert sum(unfolded) == pytest.approx(sum(token), rel=0.05)
    refolded = quantiles(_fold(unfolded, 0.15, 0.0004), 128)
    for q in (64, 115, 125):  # median, p90, p98: the fit is approximate, not 25-40% over
        assert refolded[q] == pytest.approx(chunk[q], rel=0.2)


def test_calibrated_gaps_are_per_token_when_the_client_saw_fewer_chunks() -> None:
    """14% of tiny-llava's tokens reach the client with no text; the simulator folds them
    into the next gap itself, so the drawn overheads must be per token: drawn per chunk,
    simulated gaps were 25% heavier than measured (p90-p98)."""
    cost = toy_cost_model(decode_step_s=0.005)
    token = [0.004 if i % 8 == 3 else 0.0 for i in range(40)]  # a 4 ms stall in 8 tokens
    results = []
    for i in range(20):
        step = cost.decode_s(1, 20 + 41 // 2)
        gaps, held = [], 0.0
        for j, extra in enumerate(token):
            if j % 5 == 4 and j < len(token) - 1:  # silent: runs on into the next chunk
                held += step + extra
                continue
            gaps.append(held + step + extra)
            held = 0.0
        r = _result(i, 0.15, tuple(gaps))
        results.append(dataclasses.replace(r, num_output_tokens=41, output_tokens=41))
    o = calibrate(cost, results).overheads
    assert o.silent_tokens == pytest.approx(7 / 40)
    mean = sum(o.step_s_quantiles) / len(o.step_s_quantiles)
    # 0.5 ms a token (drawn per chunk: 1.7 ms, the silent tokens' steps counted twice)
    assert mean == pytest.approx(sum(token) / len(token), abs=0.00025)


def _measured(i: int, hop_image: float, hop_kv: float, **kwargs: float) -> RequestResult:
    """``_disaggregated`` with the router's measured hops (one host: ``router.inflight``)."""
    r = _disaggregated(i, image_offer_s=hop_image, **kwargs)
    stages = dict(r.stage_s or {})
    stages.update(hop_image=hop_image, hop_kv=hop_kv, front=0.07, tail=0.03)
    return dataclasses.replace(r, stage_s=stages)


def test_a_measured_image_hop_is_taken_off_the_front_as_measured() -> None:
    """With the hop measured, the image offer is its own distribution (not the pull's) and
    the request overhead is what is left of each request's TTFT outside the stages."""
    cost = toy_cost_model(decode_step_s=0.005)
    results = [_measured(i, hop_image=0.004 + 0.001 * (i % 3), hop_kv=0.0, pull_s=0.01)
               for i in range(10)]  # fmt: skip
    calibrated = calibrate(cost, results, cpu_share=2.0)
    o = calibrated.overheads
    assert o.request_s == pytest.approx(0.1, abs=1e-9)  # each request's own hop, exactly
    assert o.image_handoff_s == pytest.approx(0.005 / 2, abs=1e-9)  # per share
    assert sorted(set(o.image_handoff_s_quantiles)) == pytest.approx([0.002, 0.0025, 0.003])
    assert o.pull_s == pytest.approx((0.01 - cost.migration_s("image", 0)) / 2, abs=1e-9)
    measured = calibrated.meta["calibration"]["measured"]
    assert measured["front_s"] == pytest.approx(0.07) and measured["tail_s"] == pytest.approx(0.03)


def test_without_measured_hops_the_image_offer_is_still_priced_as_its_pull() -> None:
    cost = toy_cost_model(decode_step_s=0.005)
    calibrated = calibrate(cost, [_disaggregated(i, image_offer_s=0.029) for i in range(10)])
    assert calibrated.overheads.image_handoff_s == pytest.approx(0.029, abs=1e-6)
    assert calibrated.meta["calibration"]["measured"]["hop_image_s"] is None


def test_a_decode_queue_before_the_prefill_ended_is_no_kv_pull() -> None:
    """An early KV offer reaches D before the prefill ends (hop_kv < 0): that part of D's
    queue is the prefill still running; the first gap's rest stays the hand-off."""
    cost = toy_cost_model(decode_step_s=0.005)
    link = cost.migration_s("kv", 20)
    early = calibrate(cost, [_measured(i, 0.004, hop_kv=-0.002) for i in range(10)]).overheads
    assert early.kv_pull_s == pytest.approx(0.03 + 0.004 - 0.002 - link, abs=1e-6)
    assert early.handoff_s == pytest.approx(0.02 + 0.002, abs=1e-6)  # the gap is kept whole
    late = calibrate(cost, [_measured(i, 0.004, hop_kv=0.003) for i in range(10)]).overheads
    assert late.kv_pull_s == pytest.approx(0.03 + 0.004 - link, abs=1e-6)  # after the offer
    assert late.handoff_s == pytest.approx(0.02, abs=1e-6)
