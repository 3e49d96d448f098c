"""The engine on a GPU: batched text and image requests give the CPU's greedy tokens, with
the vision tower on its own stream or in line (needs a GPU).

float32 on both sides with TF32 off, so the only differences left are kernel summation
order; a token that differs means paging, decode buffers, the sampler or the encode/prefill
ordering across streams is wrong on CUDA.
"""

from __future__ import annotations

import hashlib
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from epd_engine.config import EngineConfig, Role
from epd_engine.engine.llm_engine import LLMEngine
from epd_engine.inputs.images import LoadedImage
from epd_engine.inputs.processor import InputProcessor, PreparedPrompt
from epd_engine.sampling import SamplingParams

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompts(model_dir: Path, engine: LLMEngine) -> dict[str, PreparedPrompt]:
    processor = InputProcessor(model_dir, engine.model_config)
    out = {}
    for i, text in enumerate(["hello there", "the quick brown fox jumps", "a"]):
        content = [{"type": "text", "text": text}]
        out[f"text-{i}"] = processor.prepare([{"role": "user", "content": content}], [])
    for i in range(3):
        image = Image.new("RGB", (48 + 8 * i, 40), (40 + 70 * i, 200 - 50 * i, 90))
        digest = hashlib.sha256(image.tobytes()).hexdigest()
        content = [{"type": "image"}, {"type": "text", "text": "what is this?"}]
        loaded = LoadedImage(image, digest, image.width, image.height)
        out[f"image-{i}"] = processor.prepare([{"role": "user", "content": content}], [loaded])
    return out


def run(
    model_dir: Path, device: str, dual_stream: bool = True, async_scheduling: bool = False
) -> dict[str, list[int]]:
    engine = LLMEngine(
        EngineConfig(
            model_dir=model_dir, role=Role.EPD, device=device, token_budget=4096,
            image_budget=2, num_kv_blocks=256, dual_stream=dual_stream,
            async_scheduling=async_scheduling,
        )
    )  # fmt: skip
    for rid, prompt in prompts(model_dir, engine).items():
        engine.add_request(rid, prompt, GREEDY, frozenset())
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        events, _ = engine.step()
        for event in events:
            if event.new_token_id is not None:
                tokens.setdefault(event.request_id, []).append(event.new_token_id)
    return tokens


@pytest.fixture(autouse=True)
def exact_float32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False  # the CLIP patch embedding is a convolution


def test_cuda_engine_matches_cpu_engine(tiny_model_dir: Path) -> None:
    cpu = run(tiny_model_dir, "cpu")
    assert len(cpu) == 6 and all(len(t) == GREEDY.max_tokens for t in cpu.values())
    assert run(tiny_model_dir, "cuda", dual_stream=True) == cpu
    assert run(tiny_model_dir, "cuda", dual_stream=False) == cpu


def test_async_scheduling_on_cuda_gives_the_cpu_tokens(tiny_model_dir: Path) -> None:
    """Steps left in flight: pinned read-back, CUDA events, pending tokens on the device."""
    cpu = run(tiny_model_dir, "cpu")
    assert run(tiny_model_dir, "cuda", async_scheduling=True) == cpu


def test_kv_cache_sized_from_gpu_memory(tiny_model_dir: Path) -> None:
    engine = LLMEngine(
        EngineConfig(
            model_dir=tiny_model_dir, role=Role.PD, device="cuda", token_budget=64,
            gpu_memory_fraction=0.05,
        )
    )  # fmt: skip
    blocks = engine.runner.shape.num_kv_blocks
    cache_bytes = sum(t.numel() * t.element_size() for t in engine.runner.kv_caches)
    total = torch.cuda.get_device_properties(0).total_memory
    assert blocks > 512  # far more than the CPU default on any datacenter GPU
    assert cache_bytes <= 0.05 * total


def test_a_step_ahead_launch_does_not_wait_for_the_gpu(tiny_model_dir: Path) -> None:
    """With async scheduling a launch must only queue work: a blocking copy or a read-back
    inside it (``torch.cuda.set_sync_debug_mode``) would make the host wait for the step in
    flight. Greedy, temperature, min_tokens and top-k/top-p rows (on a GPU ``_truncate``
    sorts every such row on the device instead of reading a flag back)."""
    assert_decode_launches_only_queue(tiny_model_dir, with_images=True)


def test_a_qwen2_vl_step_ahead_launch_does_not_wait_for_the_gpu(tiny_qwen2_vl_dir: Path) -> None:
    """The same for an M-RoPE model on the persistent decode buffers: its cos/sin once built
    their stream index on the host, a blocking copy in every forward (``MRopeTables``)."""
    assert_decode_launches_only_queue(tiny_qwen2_vl_dir, with_images=False)


def assert_decode_launches_only_queue(model_dir: Path, with_images: bool) -> None:
    engine = LLMEngine(
        EngineConfig(
            model_dir=model_dir, role=Role.EPD, device="cuda", token_budget=4096,
            image_budget=2, num_kv_blocks=256, async_scheduling=True,
        )
    )  # fmt: skip
    launch = engine.runner.launch
    synced: list[str] = []

    def watched(out: Any, *args: Any, **kwargs: Any) -> Any:
        decode_only = not out.prefills and not out.encodes
        caught: list[str] = []

        def keep(message: Any, *_: Any, **__: Any) -> None:  # with where it was called from
            caught.append(f"{message}\n" + "".join(traceback.format_stack(limit=14)[:-1]))

        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = keep
                result = launch(out, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if decode_only:
            synced.extend(caught)
        return result

    engine.runner.launch = watched  # type: ignore[method-assign]
    await_inputs_sent = engine.runner._await_inputs_sent

    def intended_wait() -> None:  # for the last launch's inputs to leave the staging memory
        torch.cuda.set_sync_debug_mode("default")
        try:
            await_inputs_sent()
        finally:
            torch.cuda.set_sync_debug_mode("warn")

    engine.runner._await_inputs_sent = intended_wait  # type: ignore[method-assign]
    params = [
        GREEDY,
        SamplingParams(max_tokens=12, temperature=0.8, seed=3),
        SamplingParams(max_tokens=12, temperature=0.0, min_tokens=6),
        SamplingParams(max_tokens=12, temperature=0.9, top_k=40, top_p=0.8, seed=5),
    ]
    requests = prompts(model_dir, engine)
    if not with_images:
        requests = {rid: p for rid, p in requests.items() if rid.startswith("text-")}
    for i, (rid, prompt) in enumerate(requests.items()):
        engine.add_request(rid, prompt, params[i % len(params)], frozenset({2}))
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    assert steps > 12
    assert not synced, "\n".join(synced[:2])
