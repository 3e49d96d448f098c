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

``--device cuda`` runs it as an instance would on a GPU: float16, the attention backend
``auto`` picks (FlashInfer where it imports), decode CUDA graphs. The model's time is then
GPU time between CUDA events around the decoder (its graph's replay, or its eager forward)
and around the LM head; the step's is wall time, which ends with the sampler's read-back.
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

from epd_engine.bench.results_file import write_results
from epd_engine.cache.kv_cache import KVCacheManager
from epd_engine.config import Role
from epd_engine.engine.detokenizer import Detokenizer
from epd_engine.model.attention_select import attention_backend_for
from epd_engine.model.llava import LlavaLanguage
from epd_engine.model.model_config import LlavaModelConfig
from epd_engine.request import Request, RequestStatus
from epd_engine.sampling import SamplingParams, SamplingRow, SamplingSpec
from epd_engine.scheduler.scheduler import Scheduler, SchedulerLimits
from epd_engine.worker.model_runner import CacheShape, ModelRunner

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
    """Seconds the model ran: ``start``/``stop`` around each part of it. On CUDA a pair of
    timing events per part, read once the step has synchronised (``seconds``); elsewhere
    the wall clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._wall = 0.0
        self._started = 0.0
        self._begin: Any = None  # CUDA: the event recorded by the last start
        self._events: list[tuple[Any, Any]] = []  # CUDA: (begin, end) of each part

    def reset(self) -> None:
        self._wall, self._events = 0.0, []

    def start(self, *_: Any) -> None:
        if self.cuda:
            self._begin = torch.cuda.Event(enable_timing=True)
            self._begin.record()
        else:
            self._started = time.perf_counter()

    def stop(self, *_: Any) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._begin, end))
        else:
            self._wall += time.perf_counter() - self._started

    def seconds(self) -> float:
        if not self.cuda:
            return self._wall
        torch.cuda.synchronize()
        return sum(begin.elapsed_time(end) for begin, end in self._events) / 1000

    def watch(self, language: torch.nn.Module, runner: ModelRunner) -> None:
        """Clock the decoder however the runner calls it: its forward, or a graph's replay."""
        language.register_forward_pre_hook(self.start)
        language.register_forward_hook(self.stop)
        graphs = runner.graphs
        if graphs is not None:
            replay = graphs.replay

            def timed_replay(fill: Any) -> torch.Tensor:
                self.start()
                out = replay(fill)
                self.stop()
                return out

            graphs.replay = timed_replay  # type: ignore[method-assign]


@dataclasses.dataclass(frozen=True)
class Setup:
    """One run: the decoder cut to ``layers``, ``batch`` requests decoding after
    ``context`` tokens for ``steps`` timed steps, on ``device`` in ``dtype``."""

    layers: int = 2
    batch: int = 256
    context: int = 1024
    steps: int = 3
    device: str = "cpu"
    dtype: torch.dtype = torch.float32


def build(model_dir: Path, setup: Setup):
    layers, batch, context, steps = setup.layers, setup.batch, setup.context, setup.steps
    device, dtype = setup.device, setup.dtype
    tiny = LlavaModelConfig.from_dir(model_dir)
    config = dataclasses.replace(tiny, num_layers=layers, **SHAPE_7B)
    attention = attention_backend_for("auto", config, dtype, device)
    language = LlavaLanguage(config, attention).to(device, dtype).eval()
    pages_per_seq = -(-(context + steps + 1) // BLOCK_SIZE)
    shape = CacheShape(batch * pages_per_seq, BLOCK_SIZE, 1, 1, config.hidden_size)
    runner = ModelRunner(
        None,
        language,
        shape,
        dtype,
        device,
        with_image_cache=False,
        max_decode_seqs=batch,
        max_model_len=pages_per_seq * BLOCK_SIZE,
        cuda_graphs=device == "cuda",
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


def measure(model_dir: Path, setup: Setup) -> dict:
    from transformers import AutoTokenizer

    batch, context, steps, device = setup.batch, setup.context, setup.steps, setup.device
    language, runner, scheduler, params = build(model_dir, setup)
    clock = ModelClock(torch.device(device))
    clock.watch(language, runner)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    detoks = [Detokenizer(lambda ids: str(tokenizer.decode(ids)), ()) for _ in range(batch)]
    spec = SamplingSpec(params)
    records = []
    for step in range(steps + 1):  # the first is a warm-up
        clock.reset()
        start = time.perf_counter()
        out = scheduler.schedule()
        scheduled = time.perf_counter()
        tasks = out.token_tasks
        if len(tasks) != batch or any(t.num_tokens != 1 for t in tasks):
            raise RuntimeError(f"step {step}: expected {batch} decodes")
        with torch.inference_mode():
            hidden = runner.forward(tasks)
            forward_end = time.perf_counter()
            clock.start()
            logits = language.compute_logits(hidden)
            clock.stop()
            head_end = time.perf_counter()
            rows = [SamplingRow(spec, t.start_position + 1) for t in tasks]
            tokens = runner.sampler(logits, rows)  # reads the tokens back: the step syncs
        sampled_end = time.perf_counter()
        sampled = {t.request_id: tok.token_id for t, tok in zip(tasks, tokens, strict=True)}
        scheduler.update(out, sampled)
        updated = time.perf_counter()
        for detok, task in zip(detoks, tasks, strict=True):
            detok.add(sampled[task.request_id] % 1000 + 3, final=False)
        end = time.perf_counter()
        model_s = clock.seconds()  # the decoder and the LM head
        total_s = end - start
        # host time of each phase; on CUDA the GPU's model time is inside the launches'
        # wait in the sampler's read-back, so the phases there do not add up to total_ms
        records.append(
            {
                "total_ms": total_s * 1000,
                "model_ms": model_s * 1000,
                "schedule_ms": (scheduled - start) * 1000,
                "runner_ms": (forward_end - scheduled) * 1000,
                "lm_head_ms": (head_end - forward_end) * 1000,
                "sample_ms": (sampled_end - head_end) * 1000,
                "update_ms": (updated - sampled_end) * 1000,
                "detokenize_ms": (end - updated) * 1000,
                "overhead_share": 1 - model_s / total_s,
            }
        )
        if device == "cpu":  # host time is the model's time: the runner's own part
            decoder_s = model_s - (head_end - forward_end)
            records[-1]["runner_outside_model_ms"] = (forward_end - scheduled - decoder_s) * 1000
    timed = records[1:]
    shares = sorted(r["overhead_share"] for r in timed)
    overhead_ms = sorted(r["total_ms"] - r["model_ms"] for r in timed)
    return {
        "batch": batch,
        "context_tokens": context,
        "layers": setup.layers,
        "shape": SHAPE_7B,
        "device": device,
        "dtype": str(setup.dtype).removeprefix("torch."),
        "attention": type(language.attention).__name__,
        "cuda_graphs": runner.graphs is not None,
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
        "step would carry on top of its forward"
        if device == "cpu"
        else "CUDA: model_ms is GPU time between events around the decoder and the LM head",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="checkpoint (tokenizer, ids)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (float16, graphs)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = torch.float32 if args.device == "cpu" else torch.float16
    setup = Setup(args.layers, args.batch, args.context, args.steps, args.device, dtype)
    result = measure(args.model, setup)
    print(json.dumps(result, indent=2))
    if args.out:
        write_results(args.out, result)


if __name__ == "__main__":
    main()
