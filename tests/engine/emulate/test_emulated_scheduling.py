"""An emulated instance decides what the real engine decides: for the same requests, budgets
and cache sizes, each iteration batches the same tokens, images and decodes and leaves the
same KV and image pages in use (the real engine runs the tiny LLaVA on CPU; the emulated one
only waits the cost model's time). Tokens differ -- the emulated ones are made up -- so every
request has a fixed length (``ignore_eos``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from epd_engine.config import SLO, EngineConfig, Role
from epd_engine.contracts.plan import Budgets
from epd_engine.emulate.costs import EmulatedCosts
from epd_engine.emulate.engine import EmulatedEngine
from epd_engine.engine.llm_engine import LLMEngine
from epd_engine.inputs.images import LoadedImage
from epd_engine.inputs.processor import InputProcessor, PreparedPrompt
from epd_engine.profiler.cost_model import Capacity, load_cost_model
from epd_engine.request import Request
from epd_engine.sampling import SamplingParams
from epd_engine.scheduler import Scheduler
from tests.engine.model.prompts import make_images

REPO = Path(__file__).resolve().parents[3]
TOKEN_BUDGET, IMAGE_BUDGET = 24, 2  # chunked prefills; at most two images an iteration
KV_BLOCKS, BLOCK, IMAGE_BLOCKS, MAX_RUNNING = 16, 8, 6, 4  # tight: pages run out

Step = tuple[int, int, int, int, int, int]  # tokens, images, decodes, preempted, KV, image pages


def prompts(model_dir: Path, processor: InputProcessor) -> list[tuple[PreparedPrompt, int]]:
    """Seven chats (text, one or two images, a repeated prefix) and their output lengths."""
    gradient, checker, circle = make_images()
    images = [
        LoadedImage(gradient, "h-gradient", gradient.width, gradient.height),
        LoadedImage(checker, "h-checker", checker.width, checker.height),
        LoadedImage(circle, "h-circle", circle.width, circle.height),
    ]
    chats: list[tuple[list[LoadedImage], str, int]] = [
        ([], "Tell me a story about a lighthouse keeper and the sea.", 9),
        ([images[0]], "Describe this picture.", 5),
        ([images[1], images[2]], "Compare the two pictures in detail, please.", 7),
        ([], "Tell me a story about a lighthouse keeper and the sea.", 3),  # same prefix
        ([images[0]], "What colour dominates?", 12),  # same image: encoder-cache hit
        ([], "Count to ten.", 4),
        ([images[2]], "Is this round?", 6),
    ]
    out = []
    for pictures, text, num_output in chats:
        content = [{"type": "image"} for _ in pictures] + [{"type": "text", "text": text}]
        messages = [{"role": "user", "content": content}]
        out.append((processor.prepare(messages, pictures), num_output))
    return out


def pool_pages(scheduler: Scheduler) -> tuple[int, int]:
    kv = scheduler.kv.pool.num_used if scheduler.kv is not None else 0
    images = scheduler.images.pool.num_used if scheduler.images is not None else 0
    return kv, images


def test_emulated_batches_and_pages_equal_the_real_engines(tiny_model_dir: Path) -> None:
    real = LLMEngine(
        EngineConfig(
            model_dir=tiny_model_dir,
            role=Role.EPD,
            token_budget=TOKEN_BUDGET,
            image_budget=IMAGE_BUDGET,
            kv_block_size=BLOCK,
            num_kv_blocks=KV_BLOCKS,
            num_image_blocks=IMAGE_BLOCKS,
            max_num_running=MAX_RUNNING,
        )
    )
    processor = InputProcessor(tiny_model_dir, real.model_config)
    capacity = Capacity(
        num_kv_blocks=KV_BLOCKS,
        kv_block_size=BLOCK,
        num_image_blocks=IMAGE_BLOCKS,
        image_block_tokens=real.model_config.image_page_tokens,
        max_num_running=MAX_RUNNING,
        max_model_len=real.max_model_len,
    )
    h200 = load_cost_model(REPO / "benchmarks" / "results" / "cost-model-h200.json")
    costs = EmulatedCosts(dataclasses.replace(h200, capacity=capacity), "h200, test capacity")
    emulated = EmulatedEngine(
        Role.EPD, costs, SLO(), Budgets(image_budget=IMAGE_BUDGET, token_budget=TOKEN_BUDGET)
    )

    for index, (prompt, num_output) in enumerate(prompts(tiny_model_dir, processor)):
        sampling = SamplingParams(max_tokens=num_output, temperature=0.0, ignore_eos=True)
        real.add_request(f"r{index}", prompt, sampling, processor.eos_token_ids)
        emulated.add(Request(f"r{index}", list(prompt.token_ids), sampling, list(prompt.images)))

    real_steps: list[Step] = []
    while real.has_work():
        _, stats = real.step()
        real_steps.append(
            (
                stats.num_tokens,
                stats.num_images,
                stats.num_decodes,
                stats.num_preempted,
                *pool_pages(real.scheduler),
            )
        )
    emulated_steps: list[Step] = []
    while emulated.has_work():
        step = emulated.schedule()
        emulated.finish(step)
        out = step.out
        emulated_steps.append(
            (
                out.num_batched_tokens,
                len(out.encodes),
                len(out.decodes),
                len(out.preempted_ids),
                *pool_pages(emulated.scheduler),
            )
        )
    # chunked prefills, pages running out (requests preempted and recomputed): a schedule
    # worth comparing
    assert len(real_steps) > 20 and any(step[3] for step in real_steps)
    assert emulated_steps == real_steps
