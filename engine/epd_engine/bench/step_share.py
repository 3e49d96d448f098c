"""The share of a decode step spent outside the model: a whole step, 7B-shaped, few layers.

Runs the engine's own pieces for ``--batch`` requests decoding after ``--context`` tokens:
``Scheduler.schedule``, ``ModelRunner.forward`` (persistent buffers, ``prepare_decode``),
the LM head, ``Sampler``, ``Scheduler.update`` and one ``Detokenizer.add`` per request --
on a random-weight LLaMA decoder of Mistral-7B's shape (hidden 4096, 32 heads, 8 KV heads,
MLP 14336, vocabulary 32,064) cut to ``--layers`` layers. The model's time is the
decoder's ``forward`` (timed by module hooks) plus the LM head; everything else is
overhead. Prompts are not prefilled (their K/V would only cost time): the pages are
allocated and the requests enter as decoding, so the attention reads real page tables
over zeroed K/V.

On a CPU the model's forward is seconds at this size, so the share here says only that
the overhead is small next to CPU math; the absolute overhead milliseconds are what a GPU
step would carry. Run: ``python -m epd_engine.bench.step_share --model models/tiny-llava``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from epd_engine.cache.kv_cache import KVCacheManager
from epd_engine.config import Role
from epd_engine.detokenizer import Detokenizer
from epd_engine.model.llava import LlavaLanguage
from epd_engine.model.model_config import LlavaModelConfig
from epd_engine.request import Request, RequestStatus
from epd_engine.runner import CacheShape, ModelRunner
from epd_engine.sampling import SamplingParams, SamplingRow, SamplingSpec
from epd_engine.scheduler.scheduler import Scheduler, SchedulerLimits

BLOCK_SIZE = 16
SHAPE_7B: dict[str, Any] = {  # Mistral-7B (llava-v1.6-mistral-7b's decoder)
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_heads": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
    "vocab_size": 32064,
    "max_position_embeddings": 32768,
}


class ModelClock:
    """Seconds spent inside the decoder's ``forward`` (hooks around the module call)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.seconds = 0.0
        self._start = 0.0
        module.register_forward_pre_hook(self._pre)
        module.register_forward_hook(self._post)

    def _pre(self, *_: Any) -> None:
        self._start = time.perf_counter()

    def _post(self, *_: Any) -> None:
        self.seconds += time.perf_counter() - self._start


def build(model_dir: Path, layers: int, batch: int, context: int, steps: int):
    tiny = LlavaModelConfig.from_dir(model_dir)
    config = dataclasses.replace(tiny, num_layers=layers, **SHAPE_7B)
    language = LlavaLanguage(config).eval()
    pages_per_seq = -(-(context + steps + 1) // BLOCK_SIZE)
    shape = CacheShape(batch * pages_per_seq, BLOCK_SIZE, 1, 1, config.hidden_size)
    runner = ModelRunner(
        None,
        language,
        shape,
        torch.float32,
        "cpu",
        with_image_cache=False,
        max_decode_seqs=batch,
        max_model_len=pages_per_seq * BLOCK_SIZE,
    )
    kv = KVCacheManager(shape.num_kv_blocks, BLOCK_SIZE)
    limits = SchedulerLimits(
        token_budget=batch, image_token_budget=1, max_num_running=batch, max_model_len=1 << 20
    )
    scheduler = Scheduler(Role.PD, limits, kv, None)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 10)
    for i in range(batch):
        request = Request(f"r{i}", [1 + (i + j) % 1000 for j in range(context)], params)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = context
        request.output_token_ids.append(7)  # the token to decode next
        if not kv.grow(request.request_id, context + 1):
            raise RuntimeError("KV pages do not fit")
        scheduler.requests[request.request_id] = request
        scheduler.running.append(request)
    return language, runner, scheduler, params


def measure(model_dir: Path, layers: int, batch: int, context: int, steps: int) -> dict:
    from transformers import AutoTokenizer

    language, runner, scheduler, params = build(model_dir, layers, batch, context, steps)
    clock = ModelClock(language)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    detoks = [Detokenizer(lambda ids: str(tokenizer.decode(ids)), ()) for _ in range(batch)]
    spec = SamplingSpec(params)
    records = []
    for step in range(steps + 1):  # the first is a warm-up
        clock.seconds = 0.0
        start = time.perf_counter()
        out = scheduler.schedule()
        scheduled = time.perf_counter()
        tasks = out.token_tasks
        if len(tasks) != batch or any(t.num_tokens != 1 for t in tasks):
            raise RuntimeError(f"step {step}: expected {batch} decodes")
        with torch.inference_mode():
            hidden = runner.forward(tasks)
            forward_end = time.perf_counter()
            logits = language.compute_logits(hidden)
            head_end = time.perf_counter()
            rows = [SamplingRow(spec, t.start_position + 1) for t in tasks]
            tokens = runner.sampler(logits, rows)
        sampled_end = time.perf_counter()
        sampled = {t.request_id: tok.token_id for t, tok in zip(tasks, tokens, strict=True)}
        scheduler.update(out, sampled)
        updated = time.perf_counter()
        for detok, task in zip(detoks, tasks, strict=True):
            detok.add(sampled[task.request_id] % 1000 + 3, final=False)
        end = time.perf_counter()
        model_s = clock.seconds + (head_end - forward_end)
        total_s = end - start
        records.append(
            {
                "total_ms": total_s * 1000,
                "model_ms": model_s * 1000,
                "schedule_ms": (scheduled - start) * 1000,
                "runner_outside_model_ms": (forward_end - scheduled - clock.seconds) * 1000,
                "sample_ms": (sampled_end - head_end) * 1000,
                "update_ms": (updated - sampled_end) * 1000,
                "detokenize_ms": (end - updated) * 1000,
                "overhead_share": 1 - model_s / total_s,
            }
        )
    timed = records[1:]
    shares = sorted(r["overhead_share"] for r in timed)
    overhead_ms = sorted(r["total_ms"] - r["model_ms"] for r in timed)
    return {
        "batch": batch,
        "context_tokens": context,
        "layers": layers,
        "shape": SHAPE_7B,
        "dtype": "float32",
        "torch_threads": torch.get_num_threads(),
        "steps": timed,
        "overhead_share": {
            "min": shares[0],
            "median": statistics.median(shares),
            "max": shares[-1],
        },
        "overhead_ms": {
            "min": overhead_ms[0],
            "median": statistics.median(overhead_ms),
            "max": overhead_ms[-1],
        },
        "note": "CPU: the model's forward is CPU math (seconds); overhead_ms is what a GPU "
        "step would carry on top of its forward",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="checkpoint (tokenizer, ids)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = measure(args.model, args.layers, args.batch, args.context, args.steps)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
