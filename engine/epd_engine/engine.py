"""One engine instance: model parts for its role, caches, scheduler and runner (synchronous).

``LLMEngine.step()`` runs one iteration. The async server wraps it in a thread
(``async_engine.py``); the simulator drives the same scheduler without this class.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from epd_engine.cache.image_cache import ImageCacheManager
from epd_engine.cache.kv_cache import KVCacheManager
from epd_engine.config import EngineConfig, Stage
from epd_engine.model.loader import load_language, load_vision
from epd_engine.model.model_config import LlavaModelConfig
from epd_engine.processor import PreparedPrompt
from epd_engine.request import Request
from epd_engine.runner import CacheShape, ModelRunner
from epd_engine.sampling import SamplingParams
from epd_engine.scheduler import RequestEvent, Scheduler, SchedulerLimits, SchedulerOutput
from epd_engine.scheduler.budget_search import search_budget
from epd_engine.scheduler.output import TokenTask

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class StepStats:
    """What one iteration did, for metrics."""

    duration_s: float
    num_tokens: int
    num_images: int
    num_decodes: int
    stages: set[Stage] = field(default_factory=set)
    queue_waits: list[tuple[Stage, float]] = field(default_factory=list)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.device == "cpu":
            torch.set_num_threads(config.cpu_threads)
        self.model_config = LlavaModelConfig.from_dir(config.model_dir)
        dtype = _DTYPES[config.dtype]
        role = config.role
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        vision = load_vision(config.model_dir, dtype, config.device) if role.needs_vision else None
        language = (
            load_language(config.model_dir, dtype, config.device) if role.needs_language else None
        )
        with_images = role.runs(Stage.ENCODE) or role.runs(Stage.PREFILL)
        shape = CacheShape(
            num_kv_blocks=config.num_kv_blocks,
            kv_block_size=config.kv_block_size,
            num_image_blocks=config.num_image_blocks,
            image_block_tokens=self.model_config.num_image_tokens,  # one image per page
            hidden_size=self.model_config.hidden_size,
        )
        self.runner = ModelRunner(vision, language, shape, dtype, config.device, with_images)
        kv = KVCacheManager(shape.num_kv_blocks, shape.kv_block_size) if language else None
        images = (
            ImageCacheManager(shape.num_image_blocks, shape.image_block_tokens)
            if with_images
            else None
        )
        token_budget, image_budget = self._budgets()
        limits = SchedulerLimits(
            token_budget=token_budget,
            image_budget=image_budget,
            max_num_running=config.max_num_running,
            max_model_len=self.max_model_len,
        )
        self.scheduler = Scheduler(role, limits, kv, images)
        self._pixels: dict[str, list[torch.Tensor]] = {}
        self._params: dict[str, SamplingParams] = {}
        self._stage_ready_s: dict[tuple[str, Stage], float] = {}
        self._stage_started: set[tuple[str, Stage]] = set()
        log.info(
            "engine ready: role=%s token_budget=%d image_budget=%d",
            role,
            limits.token_budget,
            limits.image_budget,
        )

    # ---- budgets ----------------------------------------------------------------------
    def _budgets(self) -> tuple[int, int]:
        """Given budgets, or the largest measured batch under alpha x SLO (HydraInfer)."""
        cfg = self.config
        role = cfg.role
        limit_s = cfg.budget_alpha * (cfg.slo.tpot_s if role.decodes else cfg.slo.ttft_s)
        token_budget = cfg.token_budget
        if token_budget is None:
            if self.runner.language is None:
                token_budget = 1
            else:
                max_tokens = min(self.max_model_len - 1, cfg.num_kv_blocks * cfg.kv_block_size)
                token_budget = search_budget(self._time_prefill, limit_s, max_tokens)
        image_budget = cfg.image_budget
        if image_budget is None:
            if self.runner.vision is None:
                image_budget = 1
            else:
                max_images = min(cfg.num_image_blocks, 64)
                image_budget = search_budget(
                    self._time_encode, cfg.budget_alpha * cfg.slo.ttft_s, max_images
                )
        return token_budget, image_budget

    def _time_prefill(self, num_tokens: int) -> float:
        block_size = self.config.kv_block_size
        table = list(range(-(-num_tokens // block_size)))
        task = TokenTask("budget-probe", Stage.PREFILL, [1] * num_tokens, 0, table, sample=True)
        return _best_of(lambda: self.runner.forward([task]))

    def _time_encode(self, num_images: int) -> float:
        assert self.runner.vision is not None
        size = self.model_config.image_size
        pixels = torch.zeros(num_images, 3, size, size, dtype=self.runner.dtype)
        return _best_of(lambda: self.runner.vision(pixels.to(self.runner.device)))  # type: ignore[misc]

    # ---- requests ---------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: PreparedPrompt,
        sampling: SamplingParams,
        eos_token_ids: frozenset[int],
    ) -> Request:
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt.token_ids,
            sampling=sampling,
            images=prompt.images,
            eos_token_ids=eos_token_ids,
        )
        self.scheduler.add(request)  # raises ValueError when it can never fit
        self._pixels[request_id] = prompt.pixel_values
        self._params[request_id] = sampling
        self._mark_ready(request)
        return request

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self._forget(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> tuple[list[RequestEvent], StepStats]:
        start = time.monotonic()
        out = self.scheduler.schedule()
        stats = StepStats(0.0, out.num_batched_tokens, out.num_images, len(out.decodes))
        self._note_stage_starts(out, stats, start)
        pixels = [self._pixels[t.request_id][t.image_index] for t in out.encodes]
        sampled = self.runner.execute(out, pixels, self._params)
        events = self.scheduler.update(out, sampled)
        for event in events:
            if event.finish_reason is not None:
                self._forget(event.request_id)
        for request in self.scheduler.running:
            self._mark_ready(request)
        stats.duration_s = time.monotonic() - start
        return events, stats

    def _note_stage_starts(self, out: SchedulerOutput, stats: StepStats, now: float) -> None:
        """Per-stage queue time: from when a stage became next to its first scheduled work."""
        stats.stages = {
            *(Stage.ENCODE for _ in out.encodes[:1]),
            *(Stage.PREFILL for _ in out.prefills[:1]),
            *(Stage.DECODE for _ in out.decodes[:1]),
        }
        started = [(t.request_id, Stage.ENCODE) for t in out.encodes]
        started += [(t.request_id, t.stage) for t in out.token_tasks]
        for key in started:
            ready = self._stage_ready_s.pop(key, None)
            if ready is not None:
                self._stage_started.add(key)
                stats.queue_waits.append((key[1], now - ready))

    def _mark_ready(self, request: Request) -> None:
        key = (request.request_id, request.next_stage)
        if key not in self._stage_started and key not in self._stage_ready_s:
            self._stage_ready_s[key] = time.monotonic()

    def _forget(self, request_id: str) -> None:
        self._pixels.pop(request_id, None)
        self._params.pop(request_id, None)
        self.runner.forget(request_id)
        for stage in Stage:
            self._stage_ready_s.pop((request_id, stage), None)
            self._stage_started.discard((request_id, stage))


def _best_of(run: object, repeats: int = 3) -> float:
    """Fastest of a few runs: iteration time without scheduling noise (first run warms up)."""
    assert callable(run)
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best
