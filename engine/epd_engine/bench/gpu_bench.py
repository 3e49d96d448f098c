"""``make bench-gpu``: the engine's own model code at LLaVA-1.5-7B shapes on one GPU.

Random weights of the real size, built on the GPU (no checkpoint to read). Every figure is
read against a floor measured on the same card in the same run:

- decode step (forward + logits, the engine's decode-buffer path) at batch 1 and 64 over a
  640-token context, eager and replayed as one CUDA graph of that fixed shape, divided by
  the HBM floor: the bytes a step must read (weights, less the embedding table of which it
  reads a row per sequence, plus the KV cache) over the measured copy bandwidth;
- prefill tokens/s; encode images/s (the CLIP tower + projector);
- encode beside decode (``EncodeStream``) against encode then decode, one ``execute`` each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from epd_engine.bench.gpu_timing import Timing, copy_bandwidth, matmul_flops, time_cuda
from epd_engine.config import Stage
from epd_engine.model.attention import AttentionBackend
from epd_engine.model.attention_select import attention_backend_for
from epd_engine.model.decode_graphs import capture_graph
from epd_engine.model.llava import LlavaLanguage, LlavaVision
from epd_engine.model.model_config import LlavaModelConfig
from epd_engine.model.presets import PRESETS
from epd_engine.sampling import SamplingParams, SamplingSpec
from epd_engine.scheduler.output import EncodeTask, SchedulerOutput, TokenTask
from epd_engine.worker.encode_stream import EncodeStream
from epd_engine.worker.model_runner import CacheShape, ModelRunner

BLOCK = 16


@dataclass(frozen=True)
class GpuBenchConfig:
    preset: str = "llava-1.5-7b"
    dtype: str = "float16"
    context: int = 640  # one LLaVA-1.5 request: a 576-token image and its text
    decode_batches: tuple[int, ...] = (1, 64)
    prefill_batch: tuple[int, int] = (4, 640)  # sequences x tokens in one step
    encode_batch: int = 8
    dual_images: int = 4  # images encoded beside a batch-64 decode
    runs: int = 20
    device: str = "cuda"  # "cpu": the smoke test's tiny run (no graphs, small ceilings)
    attention: str = "auto"  # auto | torch | flashinfer (model/attention_select.py)
    ceiling_bytes: int = 4 << 30
    ceiling_matmul: int = 8192


def random_model(
    config: LlavaModelConfig, dtype: torch.dtype, device: str, attention: AttentionBackend
) -> tuple[LlavaVision, LlavaLanguage]:
    """Both parts at the checkpoint's shapes, random weights drawn on the GPU."""
    with torch.device("meta"):
        vision, language = LlavaVision(config), LlavaLanguage(config, attention)
    parts = []
    for part in (vision, language):
        module: nn.Module = part.to(dtype=dtype).to_empty(device=device)
        with torch.no_grad():
            for name, param in module.named_parameters():
                if param.dim() == 1:  # norms and biases: the identity, as after training
                    param.fill_(1.0 if name.endswith("weight") else 0.0)
                else:
                    param.normal_(0.0, 0.02)
        parts.append(module.requires_grad_(False).eval())
    return parts[0], parts[1]  # type: ignore[return-value]


@torch.inference_mode()
def run_gpu_bench(cfg: GpuBenchConfig, progress: Any = print) -> dict[str, Any]:
    dtype = getattr(torch, cfg.dtype)
    cuda = cfg.device == "cuda"
    name = torch.cuda.get_device_properties(0).name if cuda else "cpu"
    memory = torch.cuda.get_device_properties(0).total_memory if cuda else 0
    progress(f"device: {name}; measuring the ceilings")
    bandwidth = copy_bandwidth(cfg.device, cfg.ceiling_bytes)
    flops = matmul_flops(cfg.device, dtype, cfg.ceiling_matmul)
    preset = PRESETS[cfg.preset]
    model_config = LlavaModelConfig.from_dict(preset.hf_config(cfg.dtype))
    progress(f"building {cfg.preset} with random weights ({cfg.dtype})")
    attention = attention_backend_for(cfg.attention, model_config, dtype, cfg.device)
    vision, language = random_model(model_config, dtype, cfg.device, attention)
    pages_per_seq = -(-(cfg.context + 1) // BLOCK)
    max_batch = max(cfg.decode_batches)
    num_blocks = max(max_batch * pages_per_seq, cfg.prefill_batch[0] * pages_per_seq) + 1
    runner = ModelRunner(
        vision, language,
        CacheShape(num_blocks, BLOCK, 2 * cfg.encode_batch, model_config.image_page_tokens,
                   model_config.image_row_size),
        dtype, cfg.device, with_image_cache=True, max_decode_seqs=max_batch,
        max_model_len=pages_per_seq * BLOCK, cuda_graphs=cfg.device == "cuda",
    )  # fmt: skip
    for cache in runner.kv_caches:
        cache.normal_()  # never time on zeros
    out: dict[str, Any] = {
        "benchmark": "bench-gpu",
        "gpu": name,
        "gpu_memory_gib": round(memory / 2**30, 1),
        "torch": torch.__version__,
        "model": cfg.preset,
        "dtype": cfg.dtype,
        "attention_backend": type(language.attention).__name__,
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "matmul_tflops": round(flops / 1e12, 1),
        "context_tokens": cfg.context,
    }
    progress("decode steps")
    out["decode"] = [_decode(runner, language, b, cfg, bandwidth) for b in cfg.decode_batches]
    progress("prefill")
    out["prefill"] = _prefill(runner, cfg)
    progress("encode")
    out["encode"] = _encode(runner, model_config, cfg)
    progress("encode beside decode")
    out["dual_stream"] = _dual_stream(runner, model_config, cfg)
    return out


def _decode_tasks(batch: int, context: int) -> list[TokenTask]:
    pages = -(-(context + 1) // BLOCK)
    return [
        TokenTask(f"d{i}", Stage.DECODE, [3 + i], context, _pages(i, pages), sample=True)
        for i in range(batch)
    ]


def _pages(seq: int, count: int) -> list[int]:
    """Sequence ``seq``'s own run of ``count`` pages."""
    return list(range(seq * count, (seq + 1) * count))


def _decode(runner: ModelRunner, language: LlavaLanguage, batch: int, cfg: GpuBenchConfig,
            bandwidth: float) -> dict[str, Any]:  # fmt: skip
    tasks = _decode_tasks(batch, cfg.context)
    assert runner._buffered(tasks), "the decode step must take the persistent-buffer path"

    def step() -> torch.Tensor:
        return language.compute_logits(runner.forward(tasks))

    graphs, runner.graphs = runner.graphs, None
    eager = time_cuda(step, cfg.runs)
    runner.graphs = graphs
    if graphs is not None:  # the engine's own decode graphs: fill, re-plan, replay
        graph, graph_kind = time_cuda(step, cfg.runs), "engine"
    elif cfg.device == "cuda":  # the torch backend has none: this step's shape, captured once
        graph, graph_kind = _graph_timing(runner, language, tasks, cfg.runs), "fixed-shape"
    else:
        graph, graph_kind = eager, "none (cpu)"
    mc = language.config
    weight_bytes = sum(p.numel() * p.element_size() for p in language.parameters())
    embed = language.embed_tokens.weight
    weight_bytes -= embed.numel() * embed.element_size()  # a step reads one row per sequence
    element = embed.element_size()
    kv_bytes = batch * (cfg.context + 1) * mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim
    floor_s = (weight_bytes + kv_bytes * element) / bandwidth
    return {
        "batch": batch,
        "eager": eager.to_json(),
        "graph": graph.to_json(),
        "graph_kind": graph_kind,
        "hbm_floor_ms": round(floor_s * 1e3, 6),
        "eager_over_floor": round(eager.median_s / floor_s, 3),
        "graph_over_floor": round(graph.median_s / floor_s, 3),
        "tokens_per_s_eager": round(batch / eager.median_s, 1),
    }


def _graph_timing(runner: ModelRunner, language: LlavaLanguage, tasks: list[TokenTask],
                  runs: int) -> Timing:  # fmt: skip
    """The same step's forward + logits captured once and replayed: what launch overhead
    costs (inputs are prepared once, outside the graph, as a graph runner does)."""
    buffers = runner.decode_buffers
    assert buffers is not None
    fill = buffers.fill([t.token_ids[0] for t in tasks], [t.start_position + 1 for t in tasks],
                        [t.block_table for t in tasks])  # fmt: skip
    meta = language.prepare_decode(buffers, fill)
    ids = buffers.input_ids[: fill.rows]

    def forward() -> torch.Tensor:
        hidden = language(language.embed(ids), meta.positions, runner.kv_caches, meta)
        return language.compute_logits(hidden)

    with torch.inference_mode():
        graph, _ = capture_graph(forward, warmup=3)
        return time_cuda(graph.replay, runs)


def _prefill(runner: ModelRunner, cfg: GpuBenchConfig) -> dict[str, Any]:
    seqs, tokens = cfg.prefill_batch
    pages = -(-tokens // BLOCK)
    gen = torch.Generator().manual_seed(0)
    vocab = runner.language.config.vocab_size if runner.language else 2
    prompts = [torch.randint(3, vocab - 2, (tokens,), generator=gen).tolist() for _ in range(seqs)]
    tasks = [
        TokenTask(f"p{i}", Stage.PREFILL, ids, 0, _pages(i, pages), sample=True)
        for i, ids in enumerate(prompts)
    ]
    timing = time_cuda(lambda: runner.forward(tasks), max(cfg.runs // 2, 5))
    return {
        "sequences": seqs,
        "tokens_each": tokens,
        **timing.to_json(),
        "tokens_per_s": round(seqs * tokens / timing.median_s, 1),
    }


def _encode_out(mc: LlavaModelConfig, images: int, first_page: int = 0) -> tuple[
        list[EncodeTask], list[torch.Tensor]]:  # fmt: skip
    size = mc.vision.image_size
    tasks = [
        EncodeTask(f"e{i}", 0, f"h{i}", mc.image_page_tokens, [first_page + i])
        for i in range(images)
    ]
    pixels = [torch.randn(3, size, size) for _ in range(images)]
    return tasks, pixels


def _encode(runner: ModelRunner, mc: LlavaModelConfig, cfg: GpuBenchConfig) -> dict[str, Any]:
    tasks, pixels = _encode_out(mc, cfg.encode_batch)
    pixels = [p.to(runner.device) for p in pixels]  # the tower's time, not the host copy's
    timing = time_cuda(lambda: runner.encode(tasks, pixels), max(cfg.runs // 2, 5))
    return {
        "images": cfg.encode_batch,
        **timing.to_json(),
        "images_per_s": round(cfg.encode_batch / timing.median_s, 1),
    }


def _dual_stream(runner: ModelRunner, mc: LlavaModelConfig, cfg: GpuBenchConfig) -> dict[str, Any]:
    """One ``execute`` of a step that encodes ``dual_images`` images and decodes the largest
    batch: with the encodes on their own stream, then in line; and each part alone."""
    decodes = _decode_tasks(max(cfg.decode_batches), cfg.context)
    encodes, pixels = _encode_out(mc, cfg.dual_images)
    spec = SamplingSpec(SamplingParams(max_tokens=1, temperature=0.0))
    spec_of = {t.request_id: spec for t in decodes}
    both = SchedulerOutput(encodes=encodes, decodes=decodes)
    results: dict[str, Timing] = {}
    dual = runner.encode_stream
    cases: list[tuple[str, EncodeStream, SchedulerOutput]] = [
        ("dual_stream", dual, both),
        ("in_line", EncodeStream(runner.device, enabled=False), both),
        ("encode_only", dual, SchedulerOutput(encodes=encodes)),
        ("decode_only", dual, SchedulerOutput(decodes=decodes)),
    ]
    for name, stream, out in cases:
        runner.encode_stream = stream
        results[name] = time_cuda(_executes(runner, out, pixels, spec_of), cfg.runs)
    runner.encode_stream = dual
    alone = results["encode_only"].median_s + results["decode_only"].median_s
    in_line, dual_s = results["in_line"].median_s, results["dual_stream"].median_s
    return {
        "images": cfg.dual_images,
        "decode_batch": max(cfg.decode_batches),
        **{name: t.to_json() for name, t in results.items()},
        "in_line_over_dual": round(in_line / dual_s, 3),
        "best_possible": round(
            alone / max(results["encode_only"].median_s, results["decode_only"].median_s), 3
        ),
    }


def _executes(runner: ModelRunner, out: SchedulerOutput, pixels: list[torch.Tensor],
              spec_of: dict[str, SamplingSpec]) -> Callable[[], object]:  # fmt: skip
    return lambda: runner.execute(out, pixels, spec_of)
