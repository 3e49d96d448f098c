"""Measure iteration times with the real ``ModelRunner`` and fit a ``FittedCostModel``.

The runner is built the way ``LLMEngine`` builds it (same loaders, cache shapes, dtype), and
every sample runs ``ModelRunner.execute`` on a hand-made ``SchedulerOutput``: encode-only
batches (1..N images), prefill chunks (sizes x contexts), decode batches (sizes x context
lengths) and co-located batches (encode + prefill + decodes). Each time is the best of a few
runs after a warm-up (``timing.best_of``, as the engine times itself at start-up). On CPU
it runs with the engine's torch thread count (``EngineConfig.cpu_threads``, 1: instances
share the host's cores), not torch's default of one thread per core, which times a
different (and on a busy host, erratic) runner. Each transfer backend's link is measured
with ``bench-transfer``'s code (``measure_links``). ``tensor_parallel_size`` > 1 times the
language model split over that many ranks, as ``serve --tensor-parallel-size`` runs it.
torch is imported only here, lazily.
"""

from __future__ import annotations

import platform
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from epd_engine import __version__
from epd_engine.config import EngineConfig, Stage
from epd_engine.profiler.cost_model import (
    BatchShape,
    Capacity,
    FittedCostModel,
    MigrationCoeffs,
    config_fingerprint,
)
from epd_engine.profiler.fit import Sample, fit_encode, fit_language, fit_overlap, robust
from epd_engine.profiler.links import MEASURED_BACKENDS, LinkCoeffs, fit_link
from epd_engine.profiler.rank_costs import RankCosts, RankedShape
from epd_engine.sampling import SamplingParams, SamplingSpec
from epd_engine.scheduler.output import EncodeTask, SchedulerOutput, TokenTask
from epd_engine.timing import best_of

_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
LINK_BULK_BYTES = 32 << 20  # bulk pull for the link bandwidth: long next to a transfer's latency


@dataclass(frozen=True)
class ProfileConfig:
    model_dir: Path
    device: str = "cpu"
    dtype: str = "float32"
    num_kv_blocks: int = 512
    kv_block_size: int = 16
    num_image_blocks: int = 64
    max_num_running: int = 256
    max_images: int = 16
    max_prefill_tokens: int = 1024
    max_decode_batch: int = 64
    repeats: int = 3
    rounds: int = 3  # passes over all batches; the minimum per batch is kept (noisy hosts)
    cpu_threads: int = EngineConfig.cpu_threads  # torch threads on CPU, as each instance runs
    kv_layers_per_group: int = 8  # KV moves in groups of this many layers, as the engine's
    show_progress: bool = True
    tensor_parallel_size: int = 1  # ranks the language model is split over (parallel/)


# Sides (pixels) of the extra probe images of a resolution-dependent model (Qwen2-VL: 64 and
# 1024 tokens, around the 256 of its 448-pixel representative image), so the encode fit spans
# the image sizes traces have, not one size.
VARIABLE_PROBE_SIDES = (224, 896)


def _powers(limit: int, start: int = 1) -> list[int]:
    values, n = [], start
    while n < limit:
        values.append(n)
        n *= 2
    return [*values, limit]


class RunnerProbe:
    """The real runner plus helpers that build batches of a given composition."""

    def __init__(self, config: ProfileConfig) -> None:
        import torch

        from epd_engine.model.attention_select import attention_backend_for
        from epd_engine.model.loader import load_language, load_vision
        from epd_engine.model.registry import load_model_config
        from epd_engine.parallel.messages import RunnerSetup
        from epd_engine.parallel.sharding import shard_config
        from epd_engine.transfer.memory import dtype_of
        from epd_engine.worker.model_runner import CacheShape, ModelRunner

        self.torch = torch
        self.config = config
        if config.device == "cpu":
            torch.set_num_threads(config.cpu_threads)
        self.model = load_model_config(config.model_dir)
        dtype = dtype_of(config.dtype)
        # the other ranks start (and load) beside this one, as an engine's do
        self.ranks = _start_ranks(config, self.model.vocab_size)
        tp = self.ranks.tp if self.ranks is not None else None
        rank_model = shard_config(self.model, tp.shard) if tp is not None else self.model
        vision = load_vision(config.model_dir, dtype, config.device)
        # the kernels the engine would run here: FlashInfer (and decode graphs) on a GPU
        attention = attention_backend_for("auto", rank_model, dtype, config.device)
        language = load_language(config.model_dir, dtype, config.device, attention, tp)
        self.shape = CacheShape(
            num_kv_blocks=config.num_kv_blocks,
            kv_block_size=config.kv_block_size,
            num_image_blocks=config.num_image_blocks,
            image_block_tokens=self.model.image_page_tokens,
            image_row_size=self.model.image_row_size,
        )
        self.max_context = min(
            self.model.max_position_embeddings - 1, config.num_kv_blocks * config.kv_block_size
        )
        if self.ranks is not None:
            self.ranks.setup(RunnerSetup(self.shape, config.max_num_running, self.max_context + 1))
        self.runner = ModelRunner(
            vision, language, self.shape, dtype, config.device, True,
            max_decode_seqs=config.max_num_running, max_model_len=self.max_context + 1,
            cuda_graphs=True, ranks=self.ranks,
        )  # fmt: skip
        self.params = SamplingSpec(SamplingParams(max_tokens=1, temperature=0.0))
        self.pixels = vision.probe_pixels()  # one representative image
        self.image_tokens = vision.tokens_of(self.pixels)
        self.probes = {self.image_tokens: self.pixels}  # pixels by image tokens
        if self.model.fixed_image_tokens is None:  # by resolution: small and large images too
            for side in VARIABLE_PROBE_SIDES:
                pixels = vision.probe_pixels(side, side)
                self.probes[vision.tokens_of(pixels)] = pixels

    def language_bytes(self) -> int:
        """What this rank holds of the language model's weights."""
        language = self.runner.language
        assert language is not None
        return sum(p.numel() * p.element_size() for p in language.parameters())

    def close(self) -> None:
        """Stop the other ranks (a tensor-parallel probe)."""
        if self.ranks is not None:
            self.ranks.close()

    def _table(self, num_tokens: int) -> list[int]:
        # Pages may be shared between probe tasks: only timing matters, not the values.
        return [
            b % self.shape.num_kv_blocks for b in range(-(-num_tokens // self.shape.kv_block_size))
        ]

    def batch(
        self,
        num_images: int = 0,
        prefill: tuple[int, int] | None = None,
        decodes: int = 0,
        context: int = 0,
        image_tokens: int | None = None,  # one of ``probes``; default the representative image
    ) -> SchedulerOutput:
        out = SchedulerOutput()
        tokens = image_tokens or self.image_tokens
        if tokens not in self.probes:
            raise ValueError(f"no probe image of {tokens} tokens; have {sorted(self.probes)}")
        pages = -(-tokens // self.shape.image_block_tokens)
        for i in range(num_images):
            blocks = [(i * pages + j) % self.shape.num_image_blocks for j in range(pages)]
            out.encodes.append(EncodeTask(f"img{i}", 0, f"h{i}", tokens, blocks))
        if prefill is not None:
            chunk, start = prefill
            out.prefills.append(
                TokenTask("pf", Stage.PREFILL, [1] * chunk, start, self._table(start + chunk), True)
            )
        for i in range(decodes):
            out.decodes.append(
                TokenTask(f"d{i}", Stage.DECODE, [1], context, self._table(context + 1), True)
            )
        return out

    def measure(self, out: SchedulerOutput) -> float:
        pixels = [self.probes[task.num_tokens] for task in out.encodes]
        params = {t.request_id: self.params for t in out.token_tasks}
        return best_of(
            lambda: self.runner.execute(out, pixels, params),
            self.config.repeats,
            device=self.runner.device,
        )


def _start_ranks(config: ProfileConfig, vocab_size: int) -> Any:
    """A tensor-parallel probe's other ranks (None for one rank); a lost rank fails the
    profile at its next batch."""
    if config.tensor_parallel_size == 1:
        return None
    from epd_engine.config import Role
    from epd_engine.parallel.ranks import RankLeader

    engine = EngineConfig(
        model_dir=config.model_dir, role=Role.EPD, device=config.device, dtype=config.dtype,
        tensor_parallel_size=config.tensor_parallel_size, cpu_threads=config.cpu_threads,
    )  # fmt: skip
    return RankLeader.start(engine, vocab_size, on_lost=lambda reason: None)


def _plan_batches(probe: RunnerProbe) -> list[tuple[str, SchedulerOutput]]:
    cfg = probe.config
    ctx_max = probe.max_context
    batches: list[tuple[str, SchedulerOutput]] = []
    for tokens in sorted(probe.probes):
        for n in _powers(min(cfg.max_images, cfg.num_image_blocks)):
            batches.append(("encode", probe.batch(num_images=n, image_tokens=tokens)))
    for chunk in _powers(min(cfg.max_prefill_tokens, ctx_max), 16):
        batches.append(("language", probe.batch(prefill=(chunk, 0))))
    for start in (256, 1024):
        if start + 64 <= ctx_max:
            batches.append(("language", probe.batch(prefill=(64, start))))
    for context in (32, 256, min(1024, ctx_max - 1)):
        for size in _powers(cfg.max_decode_batch):
            batches.append(("language", probe.batch(decodes=size, context=context)))
    for size in (4, 16):
        batches.append(("language", probe.batch(prefill=(128, 0), decodes=size, context=256)))
        batches.append(
            ("mixed", probe.batch(num_images=2, prefill=(128, 0), decodes=size, context=256))
        )
    return batches


def measure_samples(probe: RunnerProbe) -> list[Sample]:
    """Every batch, ``rounds`` times interleaved: another process's burst hits one round only."""
    batches = _plan_batches(probe)
    best = [float("inf")] * len(batches)
    total = len(batches) * probe.config.rounds
    with tqdm(total=total, desc="profiling", disable=not probe.config.show_progress) as bar:
        for _ in range(probe.config.rounds):
            for i, (_, out) in enumerate(batches):
                best[i] = min(best[i], probe.measure(out))
                bar.update(1)
    return [
        Sample(BatchShape.of(out), seconds, kind)
        for (kind, out), seconds in zip(batches, best, strict=True)
    ]


def measure_links(
    model: Any, dtype: str, layers_per_group: int, show_progress: bool = True
) -> dict[str, LinkCoeffs]:
    """Each transfer backend's per-transfer latency and bandwidth on this machine, with
    ``bench-transfer``'s code: pages pulled across processes through the real backends, in
    ``model``'s cache geometry (``LlavaModelConfig``), one-page pulls for the latency and a
    request of about ``LINK_BULK_BYTES`` of KV (in layer groups) for the bandwidth."""
    from epd_engine.bench.transfer_bench import Repeats, link_timings
    from epd_engine.bench.transfer_shapes import shape_of

    per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * _BYTES[dtype]
    num_tokens = max(16, LINK_BULK_BYTES // per_token)
    shape = shape_of("profile", model, dtype, num_tokens, layers_per_group)
    repeats = Repeats(bulk=5, page=30, warmup=2)
    total = len(MEASURED_BACKENDS) * (2 * repeats.warmup + repeats.bulk + repeats.page)
    with (
        tempfile.TemporaryDirectory(prefix="epd-links-") as logs,
        tqdm(total=total, desc="links", disable=not show_progress) as bar,
    ):
        timings = link_timings(shape, MEASURED_BACKENDS, repeats, Path(logs), bar.update)
    links = {}
    for name, t in timings.items():
        page, bulk = t["page"], t["kv"]
        links[name] = fit_link(page["bytes"], page["pull"]["p50_s"], bulk["bytes"],
                               bulk["num_transfers"], bulk["pull"]["p50_s"])  # fmt: skip
    return links


def environment(config: ProfileConfig) -> dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    device = config.device
    if device.startswith("cuda") and torch.cuda.is_available():
        device = torch.cuda.get_device_name(torch.device(device))
    return {
        "hardware": {
            "device": device,
            "cpu": cpu,
            "num_threads": torch.get_num_threads(),
            "host": platform.node(),
        },
        "model": {
            "dir": str(config.model_dir),
            "name": config.model_dir.name,
            "config_sha256": config_fingerprint(config.model_dir),
            "dtype": config.dtype,
        },
        "software": {
            "epd_engine": __version__,
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "platform": platform.platform(),
        },
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def profile_costs(config: ProfileConfig) -> tuple[FittedCostModel, list[Sample]]:
    """Measure on this machine and fit. Returns the model and the raw samples."""
    probe = RunnerProbe(config)
    try:
        samples = measure_samples(probe)
        language_bytes = probe.language_bytes()
    finally:
        probe.close()
    encode, encode_err, encode_dropped = robust(
        fit_encode, lambda c, s: c.at(s.image_tokens), [s for s in samples if s.kind == "encode"]
    )
    language, language_err, language_dropped = robust(
        fit_language,
        lambda c, s: c.at(s.num_tokens, s.prefill_kpairs, s.decode_kcontext, s.num_sampled),
        [s for s in samples if s.kind == "language"],
    )
    overlap = fit_overlap([s for s in samples if s.kind == "mixed"], encode, language)
    model = probe.model
    bytes_per = _BYTES[config.dtype]
    links = measure_links(model, config.dtype, config.kv_layers_per_group, config.show_progress)
    layer_bytes = 2 * model.num_kv_heads * model.head_dim * bytes_per  # one layer's, per token
    windows = getattr(model, "layer_windows", ())
    num_sliding = sum(window is not None for window in windows)
    migration = MigrationCoeffs(
        image_bytes_per_token=model.image_row_size * bytes_per,
        kv_bytes_per_token=(model.num_layers - num_sliding) * layer_bytes,
        kv_transfers=-(-model.num_layers // config.kv_layers_per_group),
        kv_windowed_bytes_per_token=num_sliding * layer_bytes,
        kv_window_tokens=getattr(model, "sliding_window", None) or 0,
    )
    capacity = Capacity(
        num_kv_blocks=config.num_kv_blocks,
        kv_block_size=config.kv_block_size,
        num_image_blocks=config.num_image_blocks,
        image_block_tokens=model.image_page_tokens,
        max_num_running=config.max_num_running,
        max_model_len=model.max_position_embeddings,
        tokens_per_image=model.fixed_image_tokens,  # None: the trace's per-image tokens
    )
    meta = environment(config)
    meta["tensor_parallel_size"] = config.tensor_parallel_size
    meta["fit"] = {
        "encode_mean_rel_error": round(encode_err, 4),
        "language_mean_rel_error": round(language_err, 4),
        "num_samples": len(samples),
        "num_dropped_as_contended": encode_dropped + language_dropped,
    }
    ranks = None
    if config.tensor_parallel_size == 1 and "collective" in links:
        from epd_engine.parallel.sharding import divisors_of

        # what the plan search projects other sizes from (profiler/tensor_parallel.sized): the
        # ranks' collectives go over the same library between processes the collective
        # backend was measured on (gloo here on a CPU, NCCL between a node's GPUs)
        ranks = RankCosts(RankedShape.of(model, bytes_per), links["collective"],
                          language_bytes, tuple(divisors_of(model)))  # fmt: skip
    fitted = FittedCostModel(
        encode, language, overlap, migration, capacity, meta, links=links, ranks=ranks
    )
    return fitted.for_backend("auto"), samples  # what `epdctl up` on this host uses


def samples_json(samples: Iterable[Sample], model: FittedCostModel) -> list[dict[str, Any]]:
    """Raw samples with the model's prediction, for the JSON's ``samples`` section."""
    return [
        {
            "kind": s.kind,
            **{k: getattr(s.shape, k) for k in s.shape.__slots__},
            "measured_s": s.seconds,
            "predicted_s": model.step_s(s.shape),
        }
        for s in samples
    ]
