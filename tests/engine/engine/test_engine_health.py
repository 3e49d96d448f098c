"""A broken device takes its instance out of service (issue 30, item 5): which step failures
are sticky device errors, the stall watchdog, and a real tiny-model engine thread whose
device "fails" (``EPD_FAULT_INJECT``'s faults: the only way to make a CPU step fail as a
GPU does after an illegal memory access or an ECC error, or hang as on a hung device).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from epd_engine.config import EngineConfig, Role
from epd_engine.contracts.errors import ServiceUnavailable
from epd_engine.engine.async_engine import AsyncEngine, RequestOutput
from epd_engine.engine.device_errors import sticky_device_error
from epd_engine.engine.health import EngineHealth
from epd_engine.engine.llm_engine import LLMEngine
from epd_engine.inputs.processor import InputProcessor, PreparedPrompt
from epd_engine.sampling import SamplingParams
from epd_engine.worker.fault_injection import INJECTED_DEVICE_ERROR, FaultSpec

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
TIMEOUT_S = 60


@pytest.mark.parametrize(
    "message",
    [
        "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be "
        "asynchronously reported at some other API call",
        "CUDA error: device-side assert triggered",
        "CUDA error: uncorrectable ECC error encountered",
        "CUDA error: unspecified launch failure",
        "CUDA error: misaligned address",
        "CUDA error: unknown error",
    ],
)
def test_sticky_device_errors_are_recognised(message: str) -> None:
    assert sticky_device_error(RuntimeError(message)) == message.splitlines()[0]


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("CUDA error: invalid argument"),
        ValueError("top_k must be >= 1"),
        IndexError("index 70000 is out of bounds for dimension 0 with size 32000"),
    ],
)
def test_other_failures_are_the_requests_own(error: Exception) -> None:
    assert sticky_device_error(error) is None


def test_a_sticky_error_is_found_behind_the_one_raised() -> None:
    try:
        try:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        except RuntimeError as exc:
            raise ValueError("sampling failed") from exc
    except ValueError as wrapped:
        assert sticky_device_error(wrapped) is not None


def test_a_stall_is_found_only_while_the_thread_has_work() -> None:
    health = EngineHealth(stall_timeout_s=0.05)
    health.sleeping()
    time.sleep(0.1)
    assert health.check() is None  # asleep for want of work: no stall
    health.working()
    assert health.ok
    time.sleep(0.1)
    reason = health.check()
    assert reason is not None and "no progress" in reason
    health.working()  # out of service for good: progress after the fact changes nothing
    assert health.check() == reason
    off = EngineHealth(stall_timeout_s=0)
    off.working()
    time.sleep(0.01)
    assert off.ok


def test_the_first_reason_stays() -> None:
    health = EngineHealth(None)
    health.fail("device error: one")
    health.fail("device error: two")
    assert health.check() == "device error: one"


def test_fault_specs() -> None:
    assert FaultSpec.parse("") is None
    assert FaultSpec.parse("device_error_after_steps:3") == FaultSpec("device_error_after_steps", 3)
    for bad in ("explode:1", "hang_after_steps", "hang_after_steps:x", "hang_after_steps:-1"):
        with pytest.raises(ValueError, match="fault injection"):
            FaultSpec.parse(bad)


# ---- a real engine thread -----------------------------------------------------------------


def make_engine(model_dir: Path, fault: str, stall_timeout_s: float = 120.0) -> AsyncEngine:
    config = EngineConfig(
        model_dir=model_dir,
        role=Role.EPD,
        token_budget=256,
        image_budget=4,
        num_kv_blocks=64,
        fault_injection=fault,
        stall_timeout_s=stall_timeout_s,
    )
    engine = LLMEngine(config)
    processor = InputProcessor(model_dir, engine.model_config)
    return AsyncEngine(engine, processor.decode)


def prompts(engine: AsyncEngine, *texts: str) -> list[PreparedPrompt]:
    processor = InputProcessor(engine.engine.config.model_dir, engine.engine.model_config)
    return [
        processor.prepare([{"role": "user", "content": [{"type": "text", "text": t}]}], [])
        for t in texts
    ]


async def run_one(engine: AsyncEngine, request_id: str, prompt: PreparedPrompt) -> RequestOutput:
    """The request's last output (with every token it got)."""
    tokens: list[int] = []
    async for output in engine.generate(request_id, prompt, GREEDY, frozenset()):
        tokens += output.new_token_ids
        if output.finish_reason is not None:
            output.new_token_ids = tokens
            return output
    raise AssertionError("no last output")


async def test_a_device_error_ends_every_request_and_refuses_new_ones(
    tiny_model_dir: Path,
) -> None:
    engine = make_engine(tiny_model_dir, "device_error_after_steps:3")
    engine.start()
    try:
        *first, late = prompts(engine, "hello", "the quick brown fox", "one two", "anyone?")
        outputs = await asyncio.wait_for(  # all three join the first step
            asyncio.gather(*(run_one(engine, f"r-{i}", p) for i, p in enumerate(first))),
            TIMEOUT_S,
        )
        reason = engine.unhealthy_reason()
        with pytest.raises(ServiceUnavailable, match="out of service"):
            await run_one(engine, "late", late)
    finally:
        engine.stop()
    for output in outputs:
        assert output.finish_reason == "error"
        assert output.error is not None and "out of service" in output.error
        assert "illegal memory access" in output.error
        assert len(output.new_token_ids) < GREEDY.max_tokens
    assert reason == f"device error: {INJECTED_DEVICE_ERROR}"
    # the failed batch was not re-run request by request: the device fails them all alike
    assert engine.engine.runner.faults.num_steps == 4
    assert not engine.engine.scheduler.has_work()


async def test_a_stalled_engine_thread_is_found_and_its_clients_told(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, "hang_after_steps:2", stall_timeout_s=0.5)
    (prompt,) = prompts(engine, "hello there")
    engine.start()
    watch = asyncio.create_task(engine.watch())
    started = time.monotonic()
    try:
        output = await asyncio.wait_for(run_one(engine, "r-0", prompt), TIMEOUT_S)
        found_s = time.monotonic() - started
        await asyncio.wait_for(watch, 5)
    finally:
        engine.engine.runner.faults.unhang.set()
        engine.stop()
    assert output.finish_reason == "error"
    assert output.error is not None and "no progress" in output.error
    assert len(output.new_token_ids) == 2  # the two steps before the hang
    assert found_s < 3
    reason = engine.unhealthy_reason()
    assert reason is not None and "stall timeout 0.5 s" in reason


async def test_a_healthy_engine_serves_on(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, "")
    (prompt,) = prompts(engine, "hello there")
    engine.start()
    try:
        output = await asyncio.wait_for(run_one(engine, "r-0", prompt), TIMEOUT_S)
    finally:
        engine.stop()
    assert output.finish_reason == "length" and output.error is None
    assert engine.unhealthy_reason() is None
