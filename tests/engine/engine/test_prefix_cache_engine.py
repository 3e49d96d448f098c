"""The prefix cache through the engine (real model, scheduler, runner): multi-turn
conversations with images give the same tokens with the cache on as off, greedy and seeded,
whole and chunked prefill, LLaVA and Qwen2-VL (M-RoPE positions come from the prompt).

Two conversations open with the same system prompt and two *different* images of the same
size (the same token ids): with the cache on, the second must not take the first's pages
past the system prompt (vLLM #21175 / #20261), or its tokens would differ from cache-off."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from epd_engine.config import EngineConfig, Role
from epd_engine.engine.llm_engine import LLMEngine
from epd_engine.inputs.images import LoadedImage
from epd_engine.inputs.processor import InputProcessor
from epd_engine.request import Request
from epd_engine.sampling import SamplingParams
from tests.engine.model.prompts import make_images

BLOCK = 8
SYSTEM = "You are a careful assistant who describes pictures in plain words."
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
SEEDED = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.95, seed=7)


def _images() -> dict[str, LoadedImage]:
    """Two different pictures of one size (same token count), and a third."""
    gradient, checker, circle = make_images()
    return {
        "x": LoadedImage(gradient.resize((64, 64)), "hash-x", 64, 64),
        "y": LoadedImage(checker.resize((64, 64)), "hash-y", 64, 64),
        "z": LoadedImage(circle, "hash-z", circle.width, circle.height),
    }


@dataclass
class Conversation:
    sampling: SamplingParams
    turns: list[tuple[list[str], str]]  # per user turn: its images, its text
    messages: list[dict[str, Any]] = field(default_factory=list)
    images: list[LoadedImage] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)


def _conversations() -> dict[str, Conversation]:
    return {
        "a": Conversation(
            GREEDY,
            [(["x"], "Describe this picture."), ([], "And its colours?"), (["z"], "Compare.")],
        ),
        "b": Conversation(SEEDED, [(["y"], "Describe this picture."), ([], "And its colours?")]),
    }


def run(
    model_dir: Path, prefix_cache: bool, token_budget: int, async_scheduling: bool = False
) -> tuple[dict[str, Any], Any]:
    """Every conversation turn by turn (the turns of all conversations run together);
    returns each turn's tokens and cached-token count, and the engine."""
    engine = LLMEngine(
        EngineConfig(
            model_dir=model_dir,
            role=Role.EPD,
            token_budget=token_budget,
            image_budget=2,
            kv_block_size=BLOCK,
            num_kv_blocks=96,
            num_image_blocks=16,
            prefix_cache=prefix_cache,
            async_scheduling=async_scheduling,
        )
    )
    processor = InputProcessor(model_dir, engine.model_config)
    pictures = _images()
    conversations = _conversations()
    results: dict[str, Any] = {}
    for turn in range(max(len(c.turns) for c in conversations.values())):
        outputs: dict[str, list[int]] = {}
        for name, conv in conversations.items():
            if turn >= len(conv.turns):
                continue
            image_names, text = conv.turns[turn]
            if not conv.messages:
                conv.messages.append({"role": "system", "content": SYSTEM})
            content = [{"type": "image"} for _ in image_names] + [{"type": "text", "text": text}]
            conv.messages.append({"role": "user", "content": content})
            conv.images += [pictures[i] for i in image_names]
            prompt = processor.prepare(conv.messages, conv.images)
            request_id = f"{name}{turn}"
            conv.requests.append(
                engine.add_request(request_id, prompt, conv.sampling, processor.eos_token_ids)
            )
            outputs[request_id] = []
        while engine.has_work():
            events, _ = engine.step()
            for event in events:
                if event.new_token_id is not None:
                    outputs[event.request_id].append(event.new_token_id)
        for name, conv in conversations.items():
            if turn < len(conv.turns):
                answer = processor.decode(outputs[f"{name}{turn}"])
                conv.messages.append({"role": "assistant", "content": answer})
        for request_id, tokens in outputs.items():
            request = next(
                r for c in conversations.values() for r in c.requests if r.request_id == request_id
            )
            results[request_id] = (tokens, request.num_cached_tokens, request.images)
    return results, engine


@pytest.fixture(scope="module", params=["tiny_model_dir", "tiny_qwen2_vl_dir"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return Path(request.getfixturevalue(request.param))


# whole prefills; chunks that cut images; async scheduling (pages keyed once tokens are known)
@pytest.mark.parametrize(
    ("token_budget", "async_scheduling"), [(512, False), (24, False), (512, True)]
)
def test_multi_turn_tokens_equal_cache_on_and_off(
    model_dir: Path, token_budget: int, async_scheduling: bool
) -> None:
    off, _ = run(model_dir, False, token_budget)
    on, engine = run(model_dir, True, token_budget, async_scheduling)
    assert {k: v[0] for k, v in on.items()} == {k: v[0] for k, v in off.items()}
    assert all(len(v[0]) > 1 for v in on.values())
    for later in ("a1", "a2", "b1"):  # the previous turns' pages were found
        assert on[later][1] > off[later][1] + BLOCK, later
    # b0's image differs from a0's (same size, same token ids): at most the pages before it
    first_image = on["b0"][2][0]
    assert on["b0"][1] <= first_image.offset
    kv = engine.scheduler.kv
    assert kv is not None and kv.pool.num_free == kv.pool.num_blocks  # no page leaked
    assert kv.num_cached_blocks > 0 and kv.num_hit_tokens > 0
