"""Issue 31's GPU questions on one instance of a released Qwen-VL shape (random weights):
does bf16 run with the family's head grouping (Qwen2-VL-7B: 28 query / 4 KV heads) on the
attention backend ``auto`` picks, is a 12.8 MP photo served (16,384 image tokens), how long
does the instance take to start, how does the measured activation peak compare with the
memory plan's reserve, and how far is decode from the HBM floor at batch 1 and 32.

    python tools/gpu/qwen_7b_probe.py --model /tmp/qwen2-vl-7b --out probe.json

Prints one JSON object (and writes it to ``--out``). Runs on CPU too with a tiny checkpoint
(``--device cpu --dtype float32 --image-side 448``), which is how it is checked here.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from epd_engine.config import EngineConfig, Role
from epd_engine.engine.llm_engine import LLMEngine
from epd_engine.inputs.images import LoadedImage
from epd_engine.inputs.processor import InputProcessor
from epd_engine.sampling import SamplingParams

HBM_BYTES_PER_S = 4.8e12  # H200 datasheet; the report gives the floor it assumed


class Lines(logging.Handler):
    """The engine's start-up log lines (memory plan, attention backend), kept for the report."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_requests(engine: LLMEngine, prompts: dict[str, Any], params: SamplingParams,
                 device: str) -> dict[str, Any]:  # fmt: skip
    """Runs ``prompts`` to the end; the time to the first token of each and the decode
    steps' times (steps that only decode, after every prompt is in)."""
    start = time.perf_counter()
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params, frozenset())
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    decode_steps: list[float] = []
    while engine.has_work():
        step_start = time.perf_counter()
        events, _ = engine.step()
        sync(device)
        now = time.perf_counter()
        new = [e for e in events if e.new_token_id is not None]
        if len(first) == len(prompts) and len(new) == len(prompts):
            decode_steps.append(now - step_start)
        for event in new:
            first.setdefault(event.request_id, now - start)
            tokens[event.request_id].append(event.new_token_id)
    return {
        "ttft_s": sorted(first.values()),
        "decode_step_ms_median": 1e3 * float(np.median(decode_steps)) if decode_steps else None,
        "decode_steps": len(decode_steps),
        "tokens": tokens,
        "all_finished": all(len(t) == params.max_tokens for t in tokens.values()),
        "wall_s": time.perf_counter() - start,
    }


def build_engine(args: argparse.Namespace, cuda_graphs: bool = True) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model_dir=args.model, role=Role.EPD, device=args.device, dtype=args.dtype,
            token_budget=args.token_budget, image_budget=1, cuda_graphs=cuda_graphs,
            async_scheduling=False,  # step times read one step at a time
        )
    )  # fmt: skip


def text_batches(engine: LLMEngine, processor: InputProcessor, args: argparse.Namespace,
                 floor_ms: float) -> dict[str, Any]:  # fmt: skip
    """Batch 1 and ``--batch`` text requests of ``--prompt-words`` words, greedy."""
    words = " ".join(f"w{i % 97}" for i in range(args.prompt_words))
    out = {}
    for batch in (1, args.batch):
        prompts = {
            f"b{batch}-{i}": processor.prepare(
                [{"role": "user", "content": [{"type": "text", "text": f"{i} {words}"}]}], []
            )
            for i in range(batch)
        }
        params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
        result = run_requests(engine, prompts, params, args.device)
        result["prompt_tokens"] = len(next(iter(prompts.values())).token_ids)
        step = result["decode_step_ms_median"]
        if step:
            result["decode_tokens_per_s"] = round(1e3 * batch / step, 1)
            result["step_over_weights_floor"] = round(step / floor_ms, 2)
        out[f"batch_{batch}"] = result
    return out


def profile_top(run: Any, rows: int = 15) -> list[str]:
    """The ops that took the most device time while ``run()`` ran (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows)
    return table.splitlines()


def peak_above(device: str, baseline: int) -> int | None:
    if not device.startswith("cuda"):
        return None
    return torch.cuda.max_memory_allocated() - baseline


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--image-side", type=int, default=3584, help="3584^2 = 12.8 MP")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=600)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--token-budget", type=int, default=8192)
    parser.add_argument("--profile-photo", action="store_true")
    parser.add_argument("--compare-eager", action="store_true", help="again without graphs")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    lines = Lines()
    logging.getLogger().addHandler(lines)
    logging.getLogger().setLevel(logging.INFO)
    report: dict[str, Any] = {"model": str(args.model), "device": args.device,
                              "dtype": args.dtype}  # fmt: skip
    if args.device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name()
    start = time.perf_counter()
    engine = build_engine(args)
    sync(args.device)
    report["start_s"] = round(time.perf_counter() - start, 2)
    report["start_log"] = [
        line for line in lines.lines
        if any(k in line for k in ("attention", "KV cache", "image cache", "graph", "engine ready"))
    ]  # fmt: skip
    processor = InputProcessor(args.model, engine.model_config)
    assert engine.runner.language is not None
    weights = sum(p.numel() * p.element_size() for p in engine.runner.language.parameters())
    embed = engine.runner.language.embed_tokens.weight
    report["language_weight_gb"] = round(weights / 1e9, 2)
    floor_ms = 1e3 * (weights - embed.numel() * embed.element_size()) / HBM_BYTES_PER_S
    report["decode_floor_ms_weights_only"] = round(floor_ms, 4)
    cuda = args.device.startswith("cuda")
    baseline = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    rng = np.random.default_rng(0)
    side = args.image_side
    photo = Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))
    content = [{"type": "image"}, {"type": "text", "text": "Describe the photo."}]
    greedy8 = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    try:
        prepare_start = time.perf_counter()
        prompt = processor.prepare(
            [{"role": "user", "content": content}], [LoadedImage(photo, "photo", side, side)]
        )
        report["photo_prepare_s"] = round(time.perf_counter() - prepare_start, 2)
        report["photo_prompt_tokens"] = len(prompt.token_ids)
        report["photo"] = run_requests(engine, {"photo": prompt}, greedy8, args.device)
        report["photo"]["peak_above_start_gb"] = _gb(peak_above(args.device, baseline))
        if cuda and args.profile_photo:  # the same photo again, new hash: encoded again
            again = processor.prepare(
                [{"role": "user", "content": content}], [LoadedImage(photo, "again", side, side)]
            )
            report["photo_profile"] = profile_top(
                lambda: run_requests(engine, {"again": again}, greedy8, args.device)
            )
    except Exception as exc:  # the report says what failed; the other parts still run
        report["photo"] = {"error": f"{type(exc).__name__}: {exc}"}

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    report["graphs_captured"] = engine.runner.graphs is not None
    report["graphs"] = text_batches(engine, processor, args, floor_ms)
    report["graphs"]["peak_above_start_gb"] = _gb(peak_above(args.device, baseline))
    if args.compare_eager:
        del engine
        if cuda:
            torch.cuda.empty_cache()
        try:
            engine = build_engine(args, cuda_graphs=False)
            report["eager"] = text_batches(engine, processor, args, floor_ms)
            report["graphs_tokens_equal_eager"] = {
                key: report["graphs"][key]["tokens"] == report["eager"][key]["tokens"]
                for key in report["eager"] if key.startswith("batch_")
            }  # fmt: skip
        except Exception as exc:
            report["eager"] = {"error": f"{type(exc).__name__}: {exc}"}
    for part in ("eager", "graphs"):  # the first two requests' first tokens are enough here
        for result in report.get(part, {}).values():
            if isinstance(result, dict) and "tokens" in result:
                result["tokens"] = {k: v[:6] for k, v in list(result["tokens"].items())[:2]}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


def _gb(value: int | None) -> float | None:
    return None if value is None else round(value / 1e9, 3)


if __name__ == "__main__":
    sys.exit(main())
