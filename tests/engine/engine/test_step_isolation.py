"""One request the engine step cannot take fails alone, never its batch (issue 12, item 2).

The defect: ``seed = 2**64`` with a temperature crashed the engine step, and all 32
concurrent streams of an EPD instance failed with "internal engine error". The edge now
refuses that seed, but whatever a request can still make the step raise must fail that
request alone. Real tiny model, real engine thread: a crafted request (a value no edge
check stops, because the router and the instance never make it: a top-k past int64, a
pixel tensor of the wrong shape, a detokenizer that raises) runs in one batch with good
text and image requests, which must finish with the tokens they get when run alone.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from PIL import Image

from epd_engine.config import EngineConfig, Role
from epd_engine.engine.async_engine import AsyncEngine, RequestOutput, RequestOutputStream
from epd_engine.engine.detokenizer import Detokenizer
from epd_engine.engine.llm_engine import REQUEST_FAILED, LLMEngine, StepStats
from epd_engine.inputs.images import LoadedImage
from epd_engine.inputs.processor import InputProcessor, PreparedPrompt
from epd_engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def processor(tiny_model_dir: Path) -> InputProcessor:
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir, role=Role.EPD, token_budget=8))
    return InputProcessor(tiny_model_dir, engine.model_config)


def text_prompt(processor: InputProcessor, text: str) -> PreparedPrompt:
    return processor.prepare([{"role": "user", "content": [{"type": "text", "text": text}]}], [])


def image_prompt(processor: InputProcessor, shade: int) -> PreparedPrompt:
    image = Image.new("RGB", (48, 40), (shade, 255 - shade, 90))
    digest = hashlib.sha256(image.tobytes()).hexdigest()
    content = [{"type": "image"}, {"type": "text", "text": "what is this?"}]
    return processor.prepare(
        [{"role": "user", "content": content}], [LoadedImage(image, digest, 48, 40)]
    )


def good_requests(processor: InputProcessor) -> dict[str, PreparedPrompt]:
    texts = ["hello there", "the quick brown fox", "one two three four five", "a"]
    prompts = {f"text-{i}": text_prompt(processor, t) for i, t in enumerate(texts)}
    prompts |= {f"image-{i}": image_prompt(processor, 40 + 100 * i) for i in range(2)}
    return prompts


def make_engine(model_dir: Path) -> LLMEngine:
    # budgets that take every request of a test into one batch
    return LLMEngine(
        EngineConfig(model_dir=model_dir, role=Role.EPD, token_budget=4096, image_budget=8)
    )


async def collect(outputs: asyncio.Queue[RequestOutput]) -> tuple[list[int], str | None]:
    tokens: list[int] = []
    while True:
        output = await outputs.get()
        tokens += output.new_token_ids
        if output.finish_reason is not None:
            return tokens, output.error


async def submit(
    engine: AsyncEngine,
    request_id: str,
    prompt: PreparedPrompt,
    params: SamplingParams,
    decode: Callable[[list[int]], str],
) -> asyncio.Queue[RequestOutput]:
    """Queue one request with its own output stream (as the server and router link do)."""
    outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
    stream = RequestOutputStream(
        outputs.put_nowait, asyncio.get_running_loop(), Detokenizer(decode), len(prompt.token_ids)
    )
    await engine.add(
        lambda: engine.engine.add_request(request_id, prompt, params, frozenset()), stream
    )
    return outputs


async def run_together(
    engine: AsyncEngine, requests: dict[str, tuple[PreparedPrompt, SamplingParams, Callable]]
) -> dict[str, tuple[list[int], str | None]]:
    """Queue every request before the engine thread starts: its first step takes them all."""
    adds = [
        asyncio.ensure_future(submit(engine, rid, prompt, params, decode))
        for rid, (prompt, params, decode) in requests.items()
    ]
    await asyncio.sleep(0.05)  # every add is in the inbox
    engine.start()
    try:
        queues = await asyncio.wait_for(asyncio.gather(*adds), TIMEOUT_S)
        results = await asyncio.wait_for(asyncio.gather(*map(collect, queues)), TIMEOUT_S)
    finally:
        engine.stop()
    return dict(zip(requests, results, strict=True))


def reference_tokens(model_dir: Path, prompts: dict[str, PreparedPrompt]) -> dict[str, list[int]]:
    """Each good request run alone on its own engine."""
    engine = make_engine(model_dir)
    out = {}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, GREEDY, frozenset())
        tokens = []
        while engine.has_work():
            events, _ = engine.step()
            tokens += [e.new_token_id for e in events if e.new_token_id is not None]
        out[request_id] = tokens
    return out


def bad_top_k(processor: InputProcessor) -> tuple[PreparedPrompt, SamplingParams]:
    """Sampling: a top-k no tensor holds (the batched top-k tensor raised for everyone)."""
    params = SamplingParams(max_tokens=6, temperature=1.0, top_k=2**70)
    return text_prompt(processor, "crafted sampling"), params


def bad_pixels(processor: InputProcessor) -> tuple[PreparedPrompt, SamplingParams]:
    """Encode: one image tensor of another shape (stacking the batch's images raised)."""
    prompt = image_prompt(processor, 7)
    prompt.pixel_values[0] = torch.zeros(3, 5, 5)
    return prompt, GREEDY


@pytest.mark.parametrize("crafted", [bad_top_k, bad_pixels], ids=["top_k", "pixels"])
async def test_a_request_the_step_cannot_take_fails_alone(
    tiny_model_dir: Path, processor: InputProcessor, crafted: Callable
) -> None:
    good = good_requests(processor)
    expected = reference_tokens(tiny_model_dir, good)
    steps: list[StepStats] = []
    engine = AsyncEngine(make_engine(tiny_model_dir), processor.decode, on_step=steps.append)
    bad_prompt, bad_params = crafted(processor)
    requests = {rid: (prompt, GREEDY, processor.decode) for rid, prompt in good.items()}
    requests["crafted"] = (bad_prompt, bad_params, processor.decode)

    results = await run_together(engine, requests)

    assert {rid: results[rid] for rid in good} == {rid: (expected[rid], None) for rid in good}
    assert results["crafted"] == ([], REQUEST_FAILED)
    failing = [s for s in steps if s.failed]
    assert [list(s.failed) for s in failing] == [["crafted"]]
    assert failing[0].num_tokens > len(bad_prompt.token_ids)  # the good ones were in it
    assert not engine.engine.scheduler.requests  # nothing left holding pages
    assert engine.engine.scheduler.kv is not None
    assert engine.engine.scheduler.kv.pool.num_free == engine.engine.runner.shape.num_kv_blocks


async def test_a_request_whose_output_cannot_be_decoded_fails_alone(
    tiny_model_dir: Path, processor: InputProcessor
) -> None:
    """Handling a step's events is per request too: a detokenizer that raised used to
    escape the engine thread's loop and stop it, and every other request hung."""

    def broken_decode(token_ids: list[int]) -> str:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "crafted")

    good = good_requests(processor)
    expected = reference_tokens(tiny_model_dir, good)
    engine = AsyncEngine(make_engine(tiny_model_dir), processor.decode)
    requests = {rid: (prompt, GREEDY, processor.decode) for rid, prompt in good.items()}
    requests["crafted"] = (text_prompt(processor, "crafted output"), GREEDY, broken_decode)

    results = await run_together(engine, requests)

    assert {rid: results[rid] for rid in good} == {rid: (expected[rid], None) for rid in good}
    assert results["crafted"] == ([], REQUEST_FAILED)
    assert not engine.engine.scheduler.requests


def test_a_prompt_token_outside_the_vocabulary_is_refused_at_admission(
    tiny_model_dir: Path,
) -> None:
    """An out-of-range embedding lookup is a device-side assert on a GPU, which no step
    after it survives: the engine refuses the request before it is queued."""
    engine = make_engine(tiny_model_dir)
    vocab_size = engine.model_config.vocab_size
    for token in (vocab_size, -1):
        with pytest.raises(ValueError, match="prompt token ids must be in"):
            engine.add_request("r", PreparedPrompt([1, token], [], []), GREEDY, frozenset())
    assert not engine.has_work()
