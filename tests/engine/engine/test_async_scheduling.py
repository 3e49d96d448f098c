"""Async scheduling (``engine_inflight.py``): a step left in flight while the next one is
scheduled and launched gives exactly the synchronous engine's tokens and finishes.

On a CPU the runner executes a launch at once, so these tests check the bookkeeping --
placeholders, provisional updates, pending tokens read from the previous draws, EOS found
one step late, aborts and stop strings meanwhile, preemption, length limits -- not the
overlap itself (that needs a GPU: ``tests/engine/engine/test_engine_cuda.py``, ``docs/gpu.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from epd_engine.cache.kv_cache import KVCacheManager
from epd_engine.commands import serve
from epd_engine.config import EngineConfig, Role
from epd_engine.engine.inflight import InflightStep, resolve
from epd_engine.engine.llm_engine import LLMEngine
from epd_engine.inputs.processor import PreparedPrompt
from epd_engine.request import PENDING_TOKEN, Request, RequestStatus
from epd_engine.sampling import SampledToken, SamplingParams
from epd_engine.scheduler import RequestEvent, Scheduler, SchedulerLimits, SchedulerOutput
from epd_engine.worker.model_runner import LaunchedStep
from epd_engine.worker.sampled_batch import SampledBatch

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1, 5 + i, 17, 40 + 3 * i, 9, 22 + i] for i in range(6)]


def upto(params: SamplingParams, max_tokens: int) -> SamplingParams:
    return dataclasses.replace(params, max_tokens=max_tokens)


Arrivals = dict[int, list[tuple[str, list[int], SamplingParams]]]  # step -> requests added
Result = dict[str, tuple[list[int], str | None]]  # request -> tokens, finish reason


def make_engine(model_dir: Path, async_scheduling: bool, **config: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model_dir=model_dir,
            token_budget=config.pop("token_budget", 256),
            image_budget=1,
            async_scheduling=async_scheduling,
            **config,  # type: ignore[arg-type]
        )
    )


def run(
    engine: LLMEngine,
    arrivals: Arrivals,
    eos: frozenset[int] = frozenset(),
    between: Callable[[LLMEngine, int], None] | None = None,
) -> tuple[Result, int]:
    """Step until done, adding requests at their steps; returns each request's tokens and
    finish, and how many steps ended with a step in flight."""
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str | None] = {}
    in_flight = 0
    step = 0
    while step <= max(arrivals) or engine.has_work():
        for request_id, prompt, params in arrivals.get(step, []):
            engine.add_request(request_id, PreparedPrompt(prompt, [], []), params, eos)
            tokens[request_id], finish[request_id] = [], None
        if between is not None:
            between(engine, step)
        events, _ = engine.step()
        for event in events:
            assert finish[event.request_id] is None, f"event after the end of {event}"
            if event.new_token_id is not None:
                assert event.new_token_id != PENDING_TOKEN
                tokens[event.request_id].append(event.new_token_id)
            finish[event.request_id] = event.finish_reason
        in_flight += engine._inflight is not None
        step += 1
        assert step < 500, "the engine did not finish"
    return {rid: (tokens[rid], finish[rid]) for rid in tokens}, in_flight


def both(model_dir: Path, arrivals: Arrivals, **kwargs) -> tuple[Result, Result, int]:
    config = {k: kwargs.pop(k) for k in ("num_kv_blocks", "token_budget") if k in kwargs}
    sync, never = run(make_engine(model_dir, False, **config), arrivals, **kwargs)
    ahead, in_flight = run(make_engine(model_dir, True, **config), arrivals, **kwargs)
    assert never == 0
    return sync, ahead, in_flight


def test_staggered_greedy_requests_match_the_synchronous_engine(tiny_model_dir: Path) -> None:
    """Arrivals mid-decode mix prefills into steps that read pending tokens."""
    arrivals: Arrivals = {
        0: [("a", PROMPTS[0], GREEDY), ("b", PROMPTS[1], upto(GREEDY, 5))],
        3: [("c", PROMPTS[2], GREEDY)],
        4: [("d", PROMPTS[3], upto(GREEDY, 1))],  # ends at its prefill
        7: [("e", PROMPTS[4], upto(GREEDY, 2))],
    }
    sync, ahead, in_flight = both(tiny_model_dir, arrivals)
    assert ahead == sync
    assert in_flight > 10  # the path under test was taken
    assert [len(sync[r][0]) for r in "abcde"] == [12, 5, 12, 1, 2]
    assert {finish for _, finish in sync.values()} == {"length"}


@pytest.mark.parametrize("max_tokens", [12, 6, 5])
def test_an_eos_found_one_step_late_ends_the_request_where_the_sync_engine_does(
    tiny_model_dir: Path, max_tokens: int
) -> None:
    """By the time a step's EOS is read back the next step holds a draw past it: dropped.
    With 6 tokens that next step has also hit the length limit, with 5 this one has: the
    EOS wins, as in the synchronous engine."""
    plain = SamplingParams(temperature=0.0, max_tokens=12)
    free_run, _ = run(make_engine(tiny_model_dir, False), {0: [("a", PROMPTS[0], plain)]})
    eos = frozenset({free_run["a"][0][4]})  # the fifth token ends it
    params = upto(plain, max_tokens)
    arrivals: Arrivals = {0: [(f"r{i}", PROMPTS[i], params) for i in range(4)]}
    sync, ahead, in_flight = both(tiny_model_dir, arrivals, eos=eos)
    assert ahead == sync and in_flight > 0
    assert sync["r0"] == (free_run["a"][0][:5], "stop")


def test_seeded_sampling_matches_the_synchronous_engine(tiny_model_dir: Path) -> None:
    seeded = [SamplingParams(temperature=0.9, top_p=0.9, seed=s, max_tokens=10) for s in range(4)]
    arrivals: Arrivals = {0: [(f"s{i}", PROMPTS[i], seeded[i]) for i in range(3)]}
    arrivals[2] = [("s3", PROMPTS[3], seeded[3])]
    sync, ahead, in_flight = both(tiny_model_dir, arrivals)
    assert ahead == sync and in_flight > 0


def test_preempted_requests_recompute_over_a_pending_token(tiny_model_dir: Path) -> None:
    """Few pages: the newest requests are preempted while a step is in flight, and their
    recompute reads the token that step drew."""
    long = upto(GREEDY, 40)
    arrivals: Arrivals = {0: [(f"p{i}", PROMPTS[i], long) for i in range(4)]}
    sync, ahead, in_flight = both(tiny_model_dir, arrivals, num_kv_blocks=8)
    assert ahead == sync and in_flight > 0
    assert all(len(tokens) == 40 for tokens, _ in sync.values())


def test_a_request_aborted_while_its_step_is_in_flight_reports_nothing_more(
    tiny_model_dir: Path,
) -> None:
    def abort_b(engine: LLMEngine, step: int) -> None:
        if step == 5:
            assert engine._inflight is not None  # b's step is in flight
            engine.abort("b")

    arrivals: Arrivals = {0: [("a", PROMPTS[0], GREEDY), ("b", PROMPTS[1], GREEDY)]}
    ahead, _ = run(make_engine(tiny_model_dir, True), arrivals, between=abort_b)
    sync, _ = run(make_engine(tiny_model_dir, False), arrivals)
    assert ahead["a"] == sync["a"]
    assert ahead["b"][1] is None and ahead["b"][0] == sync["b"][0][: len(ahead["b"][0])]
    assert len(ahead["b"][0]) < 12


def test_a_stop_string_match_while_in_flight_ends_the_request(tiny_model_dir: Path) -> None:
    """``finish_stopped`` (the event loop found a stop string) during a step in flight."""

    def stop_b(engine: LLMEngine, step: int) -> None:
        if step == 6:
            engine.finish_stopped("b")

    arrivals: Arrivals = {0: [("a", PROMPTS[0], GREEDY), ("b", PROMPTS[1], GREEDY)]}
    ahead, _ = run(make_engine(tiny_model_dir, True), arrivals, between=stop_b)
    assert "b" not in ahead or ahead["b"][1] is None
    engine = make_engine(tiny_model_dir, True)
    run(engine, arrivals, between=stop_b)
    assert not engine.scheduler.requests and engine.scheduler.kv is not None
    assert engine.scheduler.kv.pool.num_free == engine.scheduler.kv.pool.num_blocks


def test_a_step_with_logprobs_is_not_left_in_flight(tiny_model_dir: Path) -> None:
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=6, logprobs=True, top_logprobs=2)
    arrivals: Arrivals = {0: [("a", PROMPTS[0], GREEDY)], 4: [("l", PROMPTS[1], with_logprobs)]}
    sync, ahead, in_flight = both(tiny_model_dir, arrivals)
    assert ahead == sync
    assert 0 < in_flight < sum(len(t) for t, _ in sync.values())


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_every_page_is_free_once_all_requests_end(
    tiny_model_dir: Path, async_scheduling: bool
) -> None:
    engine = make_engine(tiny_model_dir, async_scheduling)
    plain = SamplingParams(temperature=0.0, max_tokens=9)
    run(engine, {0: [(f"r{i}", PROMPTS[i], plain) for i in range(5)]}, eos=frozenset({3, 7}))
    kv = engine.scheduler.kv
    assert kv is not None and kv.pool.num_free == kv.pool.num_blocks
    assert not engine.scheduler.requests and engine._inflight is None


def test_a_preempted_request_whose_pending_token_is_eos_leaves_the_queue() -> None:
    """The next step's schedule preempted it (back to waiting) before its in-flight token,
    an EOS, was read: it must end, not wait forever marked as stopped."""
    kv = KVCacheManager(16, 4)
    limits = SchedulerLimits(token_budget=64, image_token_budget=1, max_num_running=4,
                             max_model_len=64)  # fmt: skip
    scheduler = Scheduler(Role.PD, limits, kv, None)
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=10), eos_token_ids=frozenset({7}))
    scheduler.add(request)
    out = scheduler.schedule()
    provisional = scheduler.update(out, {"r": PENDING_TOKEN})
    scheduler._preempt(request, SchedulerOutput())  # as the next schedule does when pages run out
    launched = LaunchedStep(["r"], SampledBatch.ready([SampledToken(7)]))
    step = InflightStep(out, launched, {"r": request}, {"r": provisional[0]}, {"r": 0})
    assert resolve(step, scheduler) == [RequestEvent("r", 7, "stop")]
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert not scheduler.waiting and "r" not in scheduler.requests
    assert kv.pool.num_free == kv.pool.num_blocks


@pytest.mark.parametrize("seed", range(4))
def test_random_arrivals_eos_and_few_pages_match_the_synchronous_engine(
    tiny_model_dir: Path, seed: int
) -> None:
    """Everything at once: arrivals, EOS tokens that often end requests, preemption."""
    rng = random.Random(seed)
    eos = frozenset(rng.sample(range(3, 200), 12))
    arrivals: Arrivals = {}
    for i in range(8):
        prompt = [1] + [rng.randrange(3, 500) for _ in range(rng.randrange(2, 20))]
        params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 30))
        arrivals.setdefault(rng.randrange(0, 12), []).append((f"q{i}", prompt, params))
    sync, ahead, in_flight = both(tiny_model_dir, arrivals, eos=eos, num_kv_blocks=10)
    assert ahead == sync and in_flight > 0


@pytest.mark.parametrize(
    ("device", "flag", "expected"),
    [("cpu", None, False), ("cuda", None, True), ("cuda:1", None, True),
     ("cuda", False, False), ("cpu", True, True)],
)  # fmt: skip
def test_async_scheduling_defaults_to_on_with_a_cuda_device(
    tiny_model_dir: Path, device: str, flag: bool | None, expected: bool
) -> None:
    """Unset, it follows the device: on where a GPU runs the step (the H200's served A/B:
    +10-29 %), off on a CPU; a flag either way wins. Defect prevented: a GPU deployment that
    does not say --async-scheduling losing that gain, as every one did while it was opt-in."""
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    argv = ["serve", "--model", str(tiny_model_dir), "--device", device]
    if flag is not None:
        argv.append("--async-scheduling" if flag else "--no-async-scheduling")
    config = serve.engine_config(parser.parse_args(argv))
    assert config.async_scheduling is expected
    assert EngineConfig(model_dir=tiny_model_dir, device=device).async_scheduling is (
        device.startswith("cuda")
    )
