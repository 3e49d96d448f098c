"""Each engine step's time, by phase (``step_phases.py``): what is measured where.

The device is faked in the second half of these tests, the one thing that cannot exist on this
host: a runner whose launch takes a known time (the host's work) and whose tokens arrive a
known time later (the device's). The phases must then say which was which, in both the
synchronous engine and with async scheduling, where a step waits for the one before it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from epd_engine.config import EngineConfig
from epd_engine.engine.llm_engine import LLMEngine, StepStats
from epd_engine.engine.step_phases import LAUNCH, SCHEDULE, UPDATE, WAIT, step_kind
from epd_engine.inputs.processor import PreparedPrompt
from epd_engine.sampling import SamplingParams
from epd_engine.worker.model_runner import LaunchedStep

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# Far apart and far above the tiny model's own forward (tens of ms on a loaded 2-core host,
# which once pushed a launch of 0.03 s + forward past 0.08 s), so the bounds below hold on a
# busy CI machine and still tell host from device time.
HOST_S = 0.1  # the fake launch's host work
DEVICE_S = 0.4  # and how long after it the fake device's tokens arrive


def test_step_kind_names_decode_only_steps() -> None:
    assert step_kind(num_tokens=8, num_decodes=8, num_images=0) == "decode"
    assert step_kind(num_tokens=40, num_decodes=8, num_images=0) == "mixed"  # a prefill chunk
    assert step_kind(num_tokens=8, num_decodes=8, num_images=1) == "mixed"  # and an encode
    assert step_kind(num_tokens=0, num_decodes=0, num_images=1) == "mixed"


def make_engine(model_dir: Path, async_scheduling: bool = False) -> LLMEngine:
    config = EngineConfig(model_dir=model_dir, token_budget=256, image_budget=1,
                          async_scheduling=async_scheduling)  # fmt: skip
    return LLMEngine(config)


def run(engine: LLMEngine, num_requests: int = 3) -> list[StepStats]:
    for i in range(num_requests):
        prompt = PreparedPrompt([1, 5 + i, 17, 40, 9], [], [])
        engine.add_request(f"r{i}", prompt, GREEDY, frozenset())
    steps = []
    while engine.has_work():
        _, stats = engine.step()
        steps.append(stats)
    return steps


def test_every_step_is_split_into_phases_that_add_up(tiny_model_dir: Path) -> None:
    steps = run(make_engine(tiny_model_dir))
    assert [step_kind(s.num_tokens, s.num_decodes, s.num_images) for s in steps] == (
        ["mixed"] + ["decode"] * 5
    )
    for stats in steps:
        assert set(stats.phases) == {SCHEDULE, LAUNCH, WAIT, UPDATE}
        # update is what the others leave of the step: negative if one were counted twice
        assert all(seconds >= 0 for seconds in stats.phases.values()), stats.phases
        assert sum(stats.phases.values()) == pytest.approx(stats.duration_s)
        assert stats.phases[LAUNCH] > 0  # on a CPU the forward runs inside the launch


class SlowDevice:
    """The runner's launch, with HOST_S of host work and tokens DEVICE_S after it."""

    def __init__(self, launch: Any) -> None:
        self.launch = launch

    def __call__(self, *args: Any, **kwargs: Any) -> LaunchedStep:
        launched = self.launch(*args, **kwargs)
        time.sleep(HOST_S)
        arrival = time.monotonic() + DEVICE_S
        result = launched.drawn.result

        def wait_for_device() -> Any:
            time.sleep(max(0.0, arrival - time.monotonic()))
            return result()

        launched.drawn.result = wait_for_device  # type: ignore[method-assign]
        return launched


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_host_work_and_device_time_land_in_launch_and_wait(
    tiny_model_dir: Path, async_scheduling: bool
) -> None:
    engine = make_engine(tiny_model_dir, async_scheduling)
    engine.runner.launch = SlowDevice(engine.runner.launch)  # type: ignore[method-assign]
    steps = run(engine)
    decodes = [s for s in steps if step_kind(s.num_tokens, s.num_decodes, s.num_images) == "decode"]
    assert decodes
    for stats in decodes:
        assert HOST_S <= stats.phases[LAUNCH] < HOST_S + DEVICE_S, stats.phases
        assert stats.phases[SCHEDULE] < HOST_S and stats.phases[UPDATE] < HOST_S
    if not async_scheduling:  # each step waits for its own tokens, the device's whole time
        for stats in decodes:
            assert DEVICE_S * 0.9 <= stats.phases[WAIT] < DEVICE_S + HOST_S, stats.phases
    else:  # a step waits for the one before, which ran on the device during this launch
        waits = [s.phases.get(WAIT, 0.0) for s in decodes]
        assert any(w > 0 for w in waits)
        assert max(waits) < DEVICE_S - HOST_S * 0.5, waits
