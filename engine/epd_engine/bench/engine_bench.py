"""Engine throughput on one machine: prefill, decode and encode, against ``transformers``.

Our side goes through the real engine: ``LLMEngine.add_request`` + ``step()`` until idle.
A step that only prefills is a prefill step, a step whose tokens are all decodes is a decode
step; decode tokens/s is decode tokens over the time of decode steps only (the first token of
each request comes from prefill, so a request of N tokens has N-1 decode tokens). The
reference is ``LlavaForConditionalGeneration.generate`` on the same files in the same process,
greedy, ``min_new_tokens = max_new_tokens`` (EOS cannot stop it), a batch of equal-length
prompts (no padding); a stopping criterion stamps the time after every generated token, so its
prefill (first token) and decode (the rest) are split the same way. Encode runs
``engine.runner.vision`` vs ``get_image_features`` on random pixels.

Both run with the same torch thread count (1 by default, the engine's ``cpu_threads``).
Rounds interleave ours and theirs over every case and keep each case's best (fastest) time,
so a load spike on a shared host hurts both sides alike. torch is imported lazily.
"""

from __future__ import annotations

import os
import platform
import random
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from epd_engine import __version__
from epd_engine.sampling import SamplingParams


@dataclass(frozen=True)
class EngineBenchConfig:
    model_dir: Path
    prefill_lengths: tuple[int, ...] = (128, 512, 1024)  # prompt tokens, one request
    decode_batches: tuple[int, ...] = (1, 8, 32)
    decode_context_tokens: int = 128  # prompt length of every decoding request
    decode_new_tokens: int = 32  # generated per request (first from prefill, rest decode)
    encode_batches: tuple[int, ...] = (1, 4, 8)
    repeats: int = 5  # interleaved rounds; the best per case is kept
    cpu_threads: int = 1  # torch threads, ours and transformers alike
    kv_block_size: int = 16
    seed: int = 0

    @classmethod
    def quick(cls, model_dir: Path) -> EngineBenchConfig:
        """Every figure, few tokens and one round: a smoke test, not a measurement."""
        return cls(model_dir, prefill_lengths=(32, 64), decode_batches=(1, 4),
                   decode_context_tokens=16, decode_new_tokens=4, encode_batches=(1, 2),
                   repeats=1)  # fmt: skip

    def __post_init__(self) -> None:
        sizes = (*self.prefill_lengths, *self.decode_batches, *self.encode_batches)
        if not all(sizes) or min(sizes) < 1 or self.decode_context_tokens < 1:
            raise ValueError("prompt lengths, batch sizes and context must be >= 1")
        if self.decode_new_tokens < 2:
            raise ValueError("decode_new_tokens must be >= 2 (the first token is prefill's)")
        if self.repeats < 1 or self.cpu_threads < 1:
            raise ValueError("repeats and cpu_threads must be >= 1")


@dataclass
class Timed:
    """Work done and the seconds it took (one phase of one run)."""

    units: int
    seconds: float

    @property
    def per_s(self) -> float:
        return self.units / self.seconds


@dataclass
class RunResult:
    prefill: Timed
    decode: Timed
    num_decode_steps: int
    num_mixed_steps: int  # steps that did both (none when the token budget fits all prompts)
    outputs: list[list[int]]


class EngineBench:
    """Our engine and the transformers model, loaded once, measured case by case."""

    def __init__(self, config: EngineBenchConfig) -> None:
        import torch
        from transformers import LlavaForConditionalGeneration

        from epd_engine.config import EngineConfig
        from epd_engine.engine.llm_engine import LLMEngine
        from epd_engine.model.model_config import LlavaModelConfig
        from epd_engine.model.registry import LLAVA, family_of

        self.config = config
        c = config
        if family_of(c.model_dir) is not LLAVA:  # the transformers reference is LLaVA's
            raise ValueError(f"{c.model_dir}: bench-engine measures LLaVA checkpoints only")
        decode_tokens = max(c.decode_batches) * c.decode_context_tokens
        self.token_budget = max(*c.prefill_lengths, decode_tokens)  # no chunking, no mixing
        blocks_per_seq = -(-(c.decode_context_tokens + c.decode_new_tokens) // c.kv_block_size)
        prefill_blocks = -(-(max(c.prefill_lengths) + 1) // c.kv_block_size)
        num_kv_blocks = max(max(c.decode_batches) * blocks_per_seq, prefill_blocks) + 1
        self.engine = LLMEngine(
            EngineConfig(
                model_dir=c.model_dir,
                token_budget=self.token_budget,
                image_budget=max(c.encode_batches),
                num_kv_blocks=num_kv_blocks,
                kv_block_size=c.kv_block_size,
                max_num_running=max(c.decode_batches),
                cpu_threads=c.cpu_threads,
            )
        )
        self.num_kv_blocks = num_kv_blocks
        torch.set_num_threads(c.cpu_threads)  # the engine did; say it again for the reference
        self.hf: Any = LlavaForConditionalGeneration.from_pretrained(
            str(c.model_dir), dtype=torch.float32
        ).eval()
        model_config = self.engine.model_config
        assert isinstance(model_config, LlavaModelConfig)
        self.model_config = model_config
        self._rng = random.Random(c.seed)
        self._next_id = 0

    def prompts(self, count: int, length: int) -> list[list[int]]:
        """Random ordinary token ids (no BOS/EOS/image/pad), fixed by the seed."""
        high = min(self.model_config.image_token_index, self.model_config.vocab_size) - 1
        return [[self._rng.randint(3, high) for _ in range(length)] for _ in range(count)]

    # ---- ours -----------------------------------------------------------------------------
    def run_ours(self, prompts: list[list[int]], max_tokens: int) -> RunResult:
        from epd_engine.inputs.processor import PreparedPrompt

        engine = self.engine
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        ids = []
        for token_ids in prompts:
            self._next_id += 1
            ids.append(f"bench-{self._next_id}")
            prompt = PreparedPrompt(list(token_ids), images=[], pixel_values=[])
            engine.add_request(ids[-1], prompt, sampling, eos_token_ids=frozenset())
        outputs: dict[str, list[int]] = {i: [] for i in ids}
        prefill, decode = Timed(0, 0.0), Timed(0, 0.0)
        num_decode_steps = num_mixed = 0
        while engine.has_work():
            start = time.perf_counter()
            events, stats = engine.step()
            elapsed = time.perf_counter() - start
            for event in events:
                if event.new_token_id is not None:
                    outputs[event.request_id].append(event.new_token_id)
            if stats.num_decodes == 0:
                prefill.units += stats.num_tokens
                prefill.seconds += elapsed
            elif stats.num_tokens == stats.num_decodes:
                decode.units += stats.num_decodes
                decode.seconds += elapsed
                num_decode_steps += 1
            else:
                num_mixed += 1
        return RunResult(prefill, decode, num_decode_steps, num_mixed, [outputs[i] for i in ids])

    def encode_ours(self, num_images: int) -> Timed:
        import torch

        vision = self.engine.runner.vision
        assert vision is not None
        pixels = self._pixels(num_images)
        with torch.inference_mode():
            return _timed(num_images, lambda: vision(pixels))

    # ---- transformers ---------------------------------------------------------------------
    def run_hf(self, prompts: list[list[int]], max_new_tokens: int) -> RunResult:
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        stamps: list[float] = []

        class StepClock(StoppingCriteria):  # called once after every generated token
            def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
                stamps.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        input_ids = torch.tensor(prompts, dtype=torch.long)  # [B, L], equal lengths: no padding
        with torch.inference_mode():
            start = time.perf_counter()
            generated = self.hf.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                pad_token_id=self.model_config.pad_token_id,
                stopping_criteria=StoppingCriteriaList([StepClock()]),
            )  # [B, L + N]
        batch = len(prompts)
        prefill = Timed(batch * len(prompts[0]), stamps[0] - start)
        decode = Timed(batch * (len(stamps) - 1), stamps[-1] - stamps[0])
        outputs = generated[:, input_ids.shape[1] :].tolist()
        return RunResult(prefill, decode, len(stamps) - 1, 0, outputs)

    def encode_hf(self, num_images: int) -> Timed:
        import torch

        pixels = self._pixels(num_images)
        vision = self.model_config.vision
        strategy = "full" if vision.keep_cls else "default"
        with torch.inference_mode():
            return _timed(
                num_images,
                lambda: self.hf.get_image_features(
                    pixel_values=pixels,
                    vision_feature_layer=vision.feature_layer,
                    vision_feature_select_strategy=strategy,
                ),
            )

    def _pixels(self, num_images: int) -> Any:
        import torch

        size = self.model_config.image_size
        generator = torch.Generator().manual_seed(self.config.seed)
        return torch.randn(num_images, 3, size, size, generator=generator)  # [N, 3, S, S]


def _timed(units: int, run: Callable[[], object], calls: int = 10) -> Timed:
    """Fastest of a few back-to-back calls: a ~1 ms call is shorter than one time slice of a
    busy host, so a single call mostly measures whether another process was scheduled."""
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return Timed(units, best)


def _same_until_eos(ours: list[int], theirs: list[int], eos_ids: Iterable[int]) -> bool:
    """Greedy outputs agree up to the first EOS: after it, ``ignore_eos`` (ours) and
    ``min_new_tokens`` (transformers masks EOS) legitimately diverge."""
    eos = set(eos_ids)
    cut = next((i for i, t in enumerate(ours) if t in eos), len(ours))
    return ours[:cut] == theirs[:cut]


def run_engine_bench(
    config: EngineBenchConfig, command: str, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Measure every case ``config.repeats`` times (interleaved rounds); return the JSON."""
    say = progress or (lambda _msg: None)
    load_start = os.getloadavg()
    bench = EngineBench(config)
    c = config
    prefill_prompts = {n: bench.prompts(1, n) for n in c.prefill_lengths}
    decode_prompts = {b: bench.prompts(b, c.decode_context_tokens) for b in c.decode_batches}
    bench.run_ours(bench.prompts(2, 8), 3)  # warm-up of every code path
    bench.run_hf(bench.prompts(2, 8), 3)
    bench.encode_ours(1)
    bench.encode_hf(1)
    best: dict[tuple[str, int, str], Timed] = {}  # (phase, size, side) -> fastest run

    def keep(phase: str, size: int, ours: Timed, hf: Timed) -> None:
        for side, new in (("ours", ours), ("hf", hf)):
            old = best.get((phase, size, side))
            best[phase, size, side] = new if old is None or new.per_s > old.per_s else old

    decode_runs: dict[int, tuple[RunResult, bool]] = {}
    eos_ids = bench.model_config.eos_token_ids
    for round_index in range(c.repeats):
        say(f"round {round_index + 1}/{c.repeats}")
        for n, prompts in prefill_prompts.items():
            for _ in range(3):  # short runs: a few per round (see _timed)
                ours_prefill = bench.run_ours(prompts, 1).prefill
                keep("prefill", n, ours_prefill, bench.run_hf(prompts, 1).prefill)
        for b, prompts in decode_prompts.items():
            ours = bench.run_ours(prompts, c.decode_new_tokens)
            theirs = bench.run_hf(prompts, c.decode_new_tokens)
            keep("decode", b, ours.decode, theirs.decode)
            same = all(map(_same_until_eos, ours.outputs, theirs.outputs, [eos_ids] * b))
            decode_runs[b] = (ours, same)
        for n in c.encode_batches:
            keep("encode", n, bench.encode_ours(n), bench.encode_hf(n))
    load_end = os.getloadavg()

    def row(phase: str, key: str, size: int, unit: str) -> dict[str, Any]:
        ours, hf = best[phase, size, "ours"], best[phase, size, "hf"]
        return {key: size, f"ours_{unit}_per_s": ours.per_s, f"hf_{unit}_per_s": hf.per_s,
                "ours_over_hf": ours.per_s / hf.per_s,
                "ours_ms": ours.seconds * 1e3, "hf_ms": hf.seconds * 1e3}  # fmt: skip

    prefill = [row("prefill", "prompt_tokens", n, "tokens") for n in c.prefill_lengths]
    decode = []
    for b in c.decode_batches:
        ours_run, same = decode_runs[b]
        decode.append({
            **row("decode", "batch", b, "tokens"),
            "context_tokens": c.decode_context_tokens,
            "new_tokens_per_request": c.decode_new_tokens,
            "decode_tokens": best["decode", b, "ours"].units,
            "ours_ms_per_step": best["decode", b, "ours"].seconds * 1e3 / ours_run.num_decode_steps,
            "hf_ms_per_step": best["decode", b, "hf"].seconds * 1e3 / (c.decode_new_tokens - 1),
            "ours_mixed_steps": ours_run.num_mixed_steps,
            "greedy_outputs_match_hf": same,
        })  # fmt: skip
    encode = [row("encode", "batch", n, "images") for n in c.encode_batches]
    return {
        "benchmark": "engine-cpu",
        "command": command,
        "created_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        **_environment(bench, load_start, load_end),
        "method": METHOD,
        "prefill": prefill,
        "decode": decode,
        "encode": encode,
        "summary": {
            "prefill_tokens_per_s": {
                str(r["prompt_tokens"]): r["ours_tokens_per_s"] for r in prefill
            },
            "decode_tokens_per_s": {str(r["batch"]): r["ours_tokens_per_s"] for r in decode},
            "decode_ours_over_hf": {str(r["batch"]): r["ours_over_hf"] for r in decode},
            "encode_images_per_s": {str(r["batch"]): r["ours_images_per_s"] for r in encode},
        },
    }


METHOD = {
    "ours": "LLMEngine.add_request + step() until idle, wall time around step(); prefill = "
    "steps with no decodes (one request of prompt_tokens, max_tokens=1); decode = steps whose "
    "tokens are all decodes (the token budget fits every prompt, so no step mixes them)",
    "hf": "LlavaForConditionalGeneration.generate, greedy, min_new_tokens = max_new_tokens, "
    "equal-length batch (no padding); a stopping criterion stamps each token: prefill = start "
    "to first token, decode = first to last token",
    "encode": "engine.runner.vision vs get_image_features (same feature layer and strategy) "
    "on randn [N, 3, S, S]",
    "ratio": "ours_over_hf = our throughput / transformers' throughput, same case, same run",
    "ms": "*_ms: the phase's time in its best run (decode: all decode steps together)",
    "repeats": "per round: decode once per case, prefill 3 runs, encode 10 calls; the best "
    "over all rounds is kept",
}


def _environment(
    bench: EngineBench, load_start: tuple[float, ...], load_end: tuple[float, ...]
) -> dict[str, Any]:
    import torch
    import transformers

    mc, c = bench.model_config, bench.config
    settings = {k: v for k, v in asdict(c).items() if k != "model_dir"}
    return {
        "model": {"dir": str(c.model_dir), "preset": _preset_name(mc), "dtype": "float32",
                  "hidden_size": mc.hidden_size, "num_layers": mc.num_layers,
                  "num_heads": mc.num_heads, "num_kv_heads": mc.num_kv_heads,
                  "vocab_size": mc.vocab_size, "image_size": mc.image_size,
                  "num_image_tokens": mc.num_image_tokens},
        "machine": {"cpu_count": os.cpu_count(), "load_average_start": list(load_start),
                    "load_average_end": list(load_end), "device": "cpu",
                    "processor": platform.processor() or platform.machine(),
                    "platform": platform.platform()},
        "software": {"epd_engine": __version__, "python": sys.version.split()[0],
                     "torch": torch.__version__, "transformers": transformers.__version__,
                     "hf_attn_implementation": bench.hf.config._attn_implementation},
        "threads": {"torch_threads": torch.get_num_threads(),
                    "torch_interop_threads": torch.get_num_interop_threads(),
                    "fair": "ours and transformers run in one process with the same torch "
                    "thread count (the engine's cpu_threads); rounds interleave them per case"},
        "settings": {**settings, "token_budget": bench.token_budget,
                     "num_kv_blocks": bench.num_kv_blocks,
                     "statistic": "best round (highest throughput) per case and side"},
    }  # fmt: skip


def _preset_name(model_config: Any) -> str:
    """The ``make-model`` preset whose shapes these are, or ``custom``."""
    from epd_engine.model.presets import PRESETS

    shape = (model_config.hidden_size, model_config.num_layers, model_config.vocab_size)
    for preset in PRESETS.values():
        text = preset.text_config
        if (text["hidden_size"], text["num_hidden_layers"], text["vocab_size"]) == shape:
            return preset.name
    return "custom"
