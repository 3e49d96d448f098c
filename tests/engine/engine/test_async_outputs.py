"""AsyncEngine's outputs: detokenized on the event loop (not the engine thread), handed over
in one loop wake-up per step, stop strings still exact and their requests' pages freed."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from epd_engine.config import EngineConfig
from epd_engine.engine.async_engine import AsyncEngine, FinalWake, RequestOutput
from epd_engine.engine.llm_engine import LLMEngine
from epd_engine.inputs.processor import InputProcessor, PreparedPrompt
from epd_engine.sampling import SamplingParams

T = TypeVar("T")
PROMPTS = [[1, 5 + i, 17, 40 + 3 * i, 9] for i in range(8)]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def engine(tiny_model_dir: Path, request: pytest.FixtureRequest) -> LLMEngine:
    """Every test runs on both engines: with async scheduling the engine thread leaves a
    step in flight, and the loop still sees the same outputs."""
    config = EngineConfig(
        model_dir=tiny_model_dir, token_budget=256, image_budget=1, async_scheduling=request.param
    )
    return LLMEngine(config)


async def _generate(
    async_engine: AsyncEngine, request_id: str, prompt: list[int], params: SamplingParams
) -> list[RequestOutput]:
    outputs = []
    async for output in async_engine.generate(
        request_id, PreparedPrompt(prompt, [], []), params, frozenset()
    ):
        outputs.append(output)
    return outputs


def _run(
    engine: LLMEngine,
    decode: Callable[[list[int]], str],
    coro_of: Callable[[AsyncEngine], Coroutine[Any, Any, T]],
) -> T:
    async_engine = AsyncEngine(engine, decode)
    async_engine.start()
    try:
        return asyncio.run(coro_of(async_engine))
    finally:
        async_engine.stop()


def test_detokenizing_runs_on_the_event_loop_not_the_engine_thread(
    engine: LLMEngine, tiny_model_dir: Path
) -> None:
    processor = InputProcessor(tiny_model_dir, engine.model_config)
    threads: set[str] = set()

    def decode(ids: list[int]) -> str:
        threads.add(threading.current_thread().name)
        return processor.decode(ids)

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = _run(engine, decode, lambda e: _generate(e, "t", PROMPTS[0], params))
    text = "".join(o.text_delta for o in outputs)
    token_ids = [t for o in outputs for t in o.new_token_ids]
    assert text == processor.decode(token_ids) and len(token_ids) == 6
    assert outputs[-1].num_output_tokens == 6
    assert threads == {threading.main_thread().name}  # never "epd-engine"


def test_one_loop_wake_up_per_step_not_per_token(engine: LLMEngine, tiny_model_dir: Path) -> None:
    processor = InputProcessor(tiny_model_dir, engine.model_config)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    wake_ups = steps = 0

    async def batch(async_engine: AsyncEngine) -> list[list[RequestOutput]]:
        nonlocal steps
        loop = asyncio.get_running_loop()
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counted(*args: Any, **kwargs: Any) -> asyncio.Handle:
            nonlocal wake_ups
            wake_ups += 1
            return call_soon_threadsafe(*args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[assignment,method-assign]
        steps_before = async_engine.num_steps
        results = await asyncio.gather(
            *(_generate(async_engine, f"b{i}", p, params) for i, p in enumerate(PROMPTS))
        )
        steps = async_engine.num_steps - steps_before
        return list(results)

    results = _run(engine, processor.decode, batch)
    assert all(len([t for o in r for t in o.new_token_ids]) == 8 for r in results)
    # 64 tokens; the 8 admissions answer once each, then one wake-up per step
    assert wake_ups <= len(PROMPTS) + steps + 2, (wake_ups, steps)


def test_a_stop_string_found_on_the_loop_ends_the_request_and_frees_its_pages(
    engine: LLMEngine, tiny_model_dir: Path
) -> None:
    processor = InputProcessor(tiny_model_dir, engine.model_config)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    full = _run(engine, processor.decode, lambda e: _generate(e, "f", PROMPTS[1], greedy))
    text = "".join(o.text_delta for o in full)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip() and text.find(stop) > 0
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=(stop,))

    async def stopped(async_engine: AsyncEngine) -> list[RequestOutput]:
        outputs = await _generate(async_engine, "s", PROMPTS[1], params)
        for _ in range(200):  # the engine thread ends it at its next iteration
            if not engine.has_work():
                break
            await asyncio.sleep(0.01)
        return outputs

    outputs = _run(engine, processor.decode, stopped)
    assert "".join(o.text_delta for o in outputs) == text[: text.find(stop)]
    assert outputs[-1].finish_reason == "stop"
    assert not engine.has_work() and not engine.scheduler.requests
    assert engine.scheduler.kv is not None and engine.scheduler.kv.pool.usage == 0


def test_a_whole_answer_is_read_once_its_last_output_has_come(
    engine: LLMEngine, tiny_model_dir: Path
) -> None:
    """A non-streaming client's outputs are kept as they come and its reader wakes once, at
    the last; they are the streaming client's outputs, each stamped when it came."""
    processor = InputProcessor(tiny_model_dir, engine.model_config)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def both(async_engine: AsyncEngine) -> tuple[list[RequestOutput], list[RequestOutput]]:
        outputs: list[RequestOutput] = []
        async for output in async_engine.generate(
            "w", PreparedPrompt(PROMPTS[2], [], []), params, frozenset(), incremental=False
        ):
            outputs.append(output)
        streamed = await _generate(async_engine, "i", PROMPTS[2], params)
        return outputs, streamed

    whole, streamed = _run(engine, processor.decode, both)
    assert [o.new_token_ids for o in whole] == [o.new_token_ids for o in streamed]
    assert "".join(o.text_delta for o in whole) == "".join(o.text_delta for o in streamed)
    stamps = [o.published_s for o in whole]
    assert stamps == sorted(stamps) and stamps[-1] > stamps[0] > 0  # per step, not per read


def test_a_whole_answer_without_stop_strings_is_decoded_once_not_per_token(
    engine: LLMEngine, tiny_model_dir: Path
) -> None:
    """The loop decoded two windows per token of every non-streaming request too: at batch
    128 that was most of its time, which the engine thread waits for on the GIL. Its text is
    now decoded once, at the end; the same text, the same token counts per output."""
    processor = InputProcessor(tiny_model_dir, engine.model_config)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    calls: list[int] = []

    def decode(ids: list[int]) -> str:
        calls.append(len(ids))
        return processor.decode(ids)

    async def whole(async_engine: AsyncEngine) -> list[RequestOutput]:
        return [
            output
            async for output in async_engine.generate(
                "w", PreparedPrompt(PROMPTS[3], [], []), params, frozenset(), incremental=False
            )
        ]

    outputs = _run(engine, decode, whole)
    streamed = _run(engine, processor.decode, lambda e: _generate(e, "i", PROMPTS[3], params))
    assert calls == [8]  # one decode, of all 8 ids
    assert "".join(o.text_delta for o in outputs) == "".join(o.text_delta for o in streamed)
    assert [o.num_output_tokens for o in outputs] == [o.num_output_tokens for o in streamed]


def test_final_wake_returns_nothing_before_the_last_output() -> None:
    async def scenario() -> list[str]:
        wake = FinalWake()
        wake.put_nowait(RequestOutput("r", "a", [1], 3, 1))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(wake.get(), timeout=0.05)
        wake.put_nowait(RequestOutput("r", "b", [2], 3, 2, finish_reason="length"))
        return [(await wake.get()).text_delta, (await wake.get()).text_delta]

    assert asyncio.run(scenario()) == ["a", "b"]
