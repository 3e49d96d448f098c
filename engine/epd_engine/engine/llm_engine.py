"""One engine instance: model parts for its role, caches, scheduler and runner (synchronous).

``LLMEngine.step()`` runs one iteration. The async server wraps it in a thread
(``async_engine.py``); the simulator drives the same scheduler without this class.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from epd_engine.cache.image_cache import ImageCacheManager
from epd_engine.cache.kv_cache import KVCacheManager, blocks_needed
from epd_engine.config import EngineConfig, Stage
from epd_engine.engine import startup
from epd_engine.engine.device_errors import sticky_device_error
from epd_engine.engine.health import EngineHealth
from epd_engine.engine.inflight import InflightStep, resolve
from epd_engine.engine.prefix_salt import prefix_salt
from epd_engine.engine.step_phases import LAUNCH, SCHEDULE, UPDATE, WAIT
from epd_engine.inputs.processor import PreparedPrompt
from epd_engine.model.attention_select import attention_backend_for
from epd_engine.model.image_bounds import largest_image_tokens, with_max_pixels
from epd_engine.model.llava import LayerWritten
from epd_engine.model.loader import load_language, load_vision
from epd_engine.model.mrope import MRopeState
from epd_engine.model.registry import RopeRule, family_of
from epd_engine.parallel.kv_staging import KvStaging
from epd_engine.parallel.messages import RunnerSetup
from epd_engine.parallel.ranks import RankLeader
from epd_engine.parallel.sharding import shard_config
from epd_engine.parallel.sizing import staging_pages
from epd_engine.request import PENDING_TOKEN, Request, RequestStatus
from epd_engine.sampling import SampledToken, SamplingParams, SamplingSpec
from epd_engine.scheduler import RequestEvent, Scheduler, SchedulerLimits, SchedulerOutput
from epd_engine.scheduler.budget_search import (
    MAX_IMAGE_SEARCH,
    image_limit_s,
    max_prefill_tokens,
    search_budget,
    token_limit_s,
)
from epd_engine.scheduler.output import PullTask, TokenTask
from epd_engine.timing import best_of
from epd_engine.transfer.memory import CacheMemory, PrivateMemory, dtype_of
from epd_engine.worker.fault_injection import FaultInjector, FaultSpec
from epd_engine.worker.kv_sizing import CPU_KV_BLOCKS, cuda_memory, kv_block_bytes
from epd_engine.worker.memory_plan import plan_gpu_memory
from epd_engine.worker.model_runner import CacheShape, ModelRunner

log = logging.getLogger(__name__)

_STAGES = tuple(Stage)  # iterating the enum itself builds a generator per call


@dataclass(frozen=True)
class StageTiming:
    """One stage of one request on this instance: how long it queued and ran, and when it
    became ready here and ended (``time.monotonic()``: comparable across the processes of one
    host only; the router derives the hops between instances from them, ``router.inflight``)."""

    request_id: str
    stage: Stage
    queue_s: float
    exec_s: float
    ready_at: float | None = None
    end_at: float | None = None


@dataclass
class StepStats:
    """What one iteration did, for metrics."""

    duration_s: float
    num_tokens: int
    num_images: int
    num_decodes: int
    stages: set[Stage] = field(default_factory=set)
    queue_waits: list[tuple[Stage, float]] = field(default_factory=list)
    stage_timings: list[StageTiming] = field(default_factory=list)
    pulls: list[PullTask] = field(default_factory=list)
    evicted_ids: list[str] = field(default_factory=list)
    num_preempted: int = 0  # running requests sent back to wait and be recomputed here
    failed: dict[str, str] = field(default_factory=dict)  # request id -> what its client sees
    idle: bool = False  # nothing could run (waiting on pages, pulls or new work)
    phases: dict[str, float] = field(default_factory=dict)  # step_phases.py: seconds each

    def add_phase(self, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds


# Engine thread, when prefill chunks whose KV will migrate are about to run: returns what to
# call after each layer has written them (or None), so the KV can move while prefill runs.
PrefillWatcher = Callable[[list[tuple[Request, TokenTask]]], LayerWritten | None]


class LLMEngine:
    def __init__(self, config: EngineConfig, memory: CacheMemory | None = None) -> None:
        """``memory``: where the caches live (shared with same-host peers for ``shm``)."""
        self.config = config
        faults = FaultInjector(FaultSpec.parse(config.fault_injection))  # before the slow part
        # out of service after a sticky device error or a stuck engine thread (health.py)
        self.health = EngineHealth(config.stall_timeout_s)
        if config.device == "cpu":
            torch.set_num_threads(config.cpu_threads)
        family = family_of(config.model_dir)
        self.model_config = with_max_pixels(  # the deployment's max_pixels rides on it
            config.model_dir, family.load_config(config.model_dir), config.processor_max_pixels
        )
        # what one image may become in tokens: the caches must hold it (issue 31)
        self.largest_image_tokens = largest_image_tokens(config.model_dir, self.model_config)
        # M-RoPE families: each request's positions, computed when it is added here.
        self._rope_rule: RopeRule | None = (
            family.rope(config.model_dir, self.model_config) if family.rope else None
        )
        self._rope: dict[str, MRopeState] = {}
        dtype = dtype_of(config.dtype)
        role = config.role
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        # tensor parallel: the other ranks start (and load their slices) beside this one
        self.ranks = (
            RankLeader.start(config, self.model_config.vocab_size, self._ranks_lost)
            if config.tensor_parallel_size > 1
            else None
        )
        tp = self.ranks.tp if self.ranks is not None else None
        # what this rank holds of the language model: its heads, MLP width and vocabulary
        self.rank_model_config = shard_config(self.model_config, tp.shard) if tp else None
        vision = load_vision(config.model_dir, dtype, config.device) if role.needs_vision else None
        language = None
        if role.needs_language:
            attention = attention_backend_for(
                config.attention_backend,
                self.rank_model_config or self.model_config,
                dtype,
                config.device,
            )
            language = load_language(config.model_dir, dtype, config.device, attention, tp)
        startup.mark("model_loaded")
        with_images = role.runs(Stage.ENCODE) or role.runs(Stage.PREFILL)
        num_image_blocks = self._num_image_blocks()
        # the token-budget search probes no longer prefill than the activation reserve covers
        # (a GPU's memory plan sets it; elsewhere the context or the KV pages bound it)
        self._max_probe_tokens: int | None = None
        image_cache_tokens = num_image_blocks * self.model_config.image_page_tokens
        shape = CacheShape(
            num_kv_blocks=self._num_kv_blocks(
                language, dtype, image_cache_tokens if with_images else 0
            ),
            kv_block_size=config.kv_block_size,
            num_image_blocks=num_image_blocks,
            image_block_tokens=self.model_config.image_page_tokens,
            image_row_size=self.model_config.image_row_size,
        )
        if self.ranks is not None:
            self.ranks.setup(RunnerSetup(shape, config.max_num_running, self.max_model_len))
        self.runner = ModelRunner(
            vision,
            language,
            shape,
            dtype,
            config.device,
            with_images,
            memory,
            max_decode_seqs=config.max_num_running,
            max_model_len=self.max_model_len,
            dual_stream=config.dual_stream,
            cuda_graphs=config.cuda_graphs,
            faults=faults,
            ranks=self.ranks,
        )
        if self.ranks is not None and language is not None:
            self.runner.staging = KvStaging(
                self.runner.kv_caches,
                config.tensor_parallel_size,
                staging_pages(self.max_model_len, config.kv_block_size),
                memory or PrivateMemory(torch.device(config.device)),
                self.ranks,
                self.ranks.tp.group,
            )
        kv = (
            KVCacheManager(shape.num_kv_blocks, shape.kv_block_size, prefix_salt(config))
            if language
            else None
        )
        images = (
            ImageCacheManager(shape.num_image_blocks, shape.image_block_tokens)
            if with_images
            else None
        )
        # what the start-up search found (not given): another instance of this role with the
        # same flags can be given them instead of searching again (GET /health/ready)
        self.searched_budgets: dict[str, int] = {}
        token_budget, image_budget = self._budgets()
        startup.mark("budgets")
        limits = SchedulerLimits(
            token_budget=token_budget,
            image_token_budget=image_budget,
            max_num_running=config.max_num_running,
            max_model_len=self.max_model_len,
            whole_images=getattr(self.model_config, "image_attention_bidirectional", False),
            sliding_window=getattr(self.model_config, "sliding_window", None),
        )
        self.scheduler = Scheduler(role, limits, kv, images)
        self._pixels: dict[str, list[torch.Tensor]] = {}
        self._sampling: dict[str, SamplingSpec] = {}
        self._stage_ready_s: dict[tuple[str, Stage], float] = {}
        self._stage_started: dict[tuple[str, Stage], tuple[float, float]] = {}  # (start, queue)
        self._stage_reported: set[tuple[str, Stage]] = set()  # timed already: never again
        self._offered: set[str] = set()
        self._inflight: InflightStep | None = None  # async scheduling: launched, unread
        self.watch_prefill: PrefillWatcher | None = None
        self.on_forget: Callable[[str], None] | None = None  # a request left this engine
        log.info(
            "engine ready: role=%s token_budget=%d image_token_budget=%d",
            role,
            limits.token_budget,
            limits.image_token_budget,
        )

    def _num_kv_blocks(self, language: Any, dtype: torch.dtype, image_cache_tokens: int) -> int:
        """The configured page count, else 512 on CPU or what this instance's share of its GPU
        leaves after the weights, the image cache and its largest step (memory_plan.py)."""
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if language is None or torch.device(cfg.device).type != "cuda":
            return self._cpu_kv_blocks()
        plan = plan_gpu_memory(
            self.rank_model_config or self.model_config,
            torch.empty((), dtype=dtype).element_size(),
            cuda_memory(torch.device(cfg.device)),
            cfg.gpu_memory_fraction,
            cfg.kv_block_size,
            image_cache_tokens,
            self.max_model_len,
            self.largest_image_tokens,
            prefills=cfg.role.runs(Stage.PREFILL),
            encodes=cfg.role.runs(Stage.ENCODE),
            staging_bytes=self._staging_bytes(dtype),
        )
        self._max_probe_tokens = plan.max_prefill_tokens or None
        log.info(
            "KV cache: %d pages of %d tokens from GPU memory (%.1f GiB kept for activations, "
            "prefill probes up to %d tokens)",
            plan.kv_blocks,
            cfg.kv_block_size,
            plan.reserve_bytes / (1 << 30),
            plan.max_prefill_tokens,
        )
        return plan.kv_blocks

    def _staging_bytes(self, dtype: torch.dtype) -> int:
        """What rank 0 of a tensor-parallel instance keeps for migrations' whole-head pages
        (``parallel/kv_staging.py``); 0 with one rank."""
        if self.ranks is None:
            return 0
        m, block_size = self.model_config, self.config.kv_block_size
        page = kv_block_bytes(m.num_layers, block_size, m.num_kv_heads, m.head_dim, dtype)
        return staging_pages(self.max_model_len, block_size) * page

    def _ranks_lost(self, reason: str) -> None:
        """Any thread: the tensor-parallel ranks cannot run a step together any more; only a
        restart (the kubelet's, on the failing liveness probe) brings them back."""
        self.health.fail(reason)

    def close(self) -> None:
        """Stop what runs beside this engine: a tensor-parallel instance's other ranks."""
        if self.ranks is not None:
            self.ranks.close()

    def _cpu_kv_blocks(self) -> int:
        """512, or room for a prompt of the largest image and as much text again (within the
        context window): a 12.8 MP image is 16,384 tokens, so 2,048 pages of 16."""
        block_size = self.config.kv_block_size
        largest_prompt = min(2 * self.largest_image_tokens, self.max_model_len)
        return max(CPU_KV_BLOCKS, blocks_needed(largest_prompt, block_size))

    def _num_image_blocks(self) -> int:
        """The configured pages, raised to hold the model's largest image: fewer would refuse
        every photo the processor makes that large (a 12.8 MP image is 16,384 tokens, 256
        pages of 64). A request whose images need more pages is refused, naming them."""
        configured = self.config.num_image_blocks
        need = blocks_needed(self.largest_image_tokens, self.model_config.image_page_tokens)
        if need > configured:
            log.info(
                "image cache: %d pages, not %d, to hold the largest image (%d tokens)",
                need,
                configured,
                self.largest_image_tokens,
            )
        return max(configured, need)

    # ---- budgets ----------------------------------------------------------------------
    def _budgets(self) -> tuple[int, int]:
        """Given budgets, or the largest measured batch under alpha x SLO (HydraInfer)."""
        cfg = self.config
        role = cfg.role
        token_budget = cfg.token_budget
        if token_budget is None:
            if self.runner.language is None:
                token_budget = 1
            else:
                max_tokens = max_prefill_tokens(
                    self.max_model_len, self.runner.shape.num_kv_blocks, cfg.kv_block_size
                )
                if self._max_probe_tokens is not None:
                    max_tokens = min(max_tokens, self._max_probe_tokens)
                limit_s = token_limit_s(role, cfg.slo, cfg.budget_alpha)
                token_budget = search_budget(self._time_prefill, limit_s, max_tokens)
                self.searched_budgets["token_budget"] = token_budget
        image_budget = cfg.image_token_budget
        page_tokens = self.model_config.image_page_tokens
        if image_budget is None and cfg.image_budget is not None:
            image_budget = cfg.image_budget * page_tokens
        if image_budget is None:
            vision = self.runner.vision
            if vision is None:
                image_budget = page_tokens  # never used: this role encodes nothing
            else:
                probe_tokens = vision.tokens_of(vision.probe_pixels())
                cache_images = self.runner.shape.num_image_blocks * page_tokens // probe_tokens
                max_images = max(1, min(cache_images, MAX_IMAGE_SEARCH))
                image_budget = probe_tokens * search_budget(
                    self._time_encode, image_limit_s(cfg.slo, cfg.budget_alpha), max_images
                )
                self.searched_budgets["image_token_budget"] = image_budget
        return token_budget, image_budget

    def _time_prefill(self, num_tokens: int) -> float:
        block_size = self.config.kv_block_size
        table = list(range(-(-num_tokens // block_size)))
        task = TokenTask("budget-probe", Stage.PREFILL, [1] * num_tokens, 0, table, sample=True)
        return best_of(lambda: self.runner.forward([task]), device=self.runner.device)

    def _time_encode(self, num_images: int) -> float:
        vision = self.runner.vision
        assert vision is not None
        image = vision.probe_pixels().to(self.runner.device, self.runner.dtype)
        pixels = [image] * num_images
        return best_of(lambda: vision.encode_images(pixels), device=self.runner.device)

    # ---- requests ---------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: PreparedPrompt,
        sampling: SamplingParams,
        eos_token_ids: frozenset[int],
        resume_output_token_ids: list[int] | None = None,
    ) -> Request:
        """Queue a request. ``resume_output_token_ids``: tokens a client already has (a retry
        after a failure elsewhere): they are recomputed into the cache, not generated again."""
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt.token_ids,
            sampling=sampling,
            images=prompt.images,
            eos_token_ids=eos_token_ids,
            output_token_ids=list(resume_output_token_ids or []),
        )
        return self.add(request, prompt.pixel_values)

    def add(self, request: Request, pixel_values: list[torch.Tensor] | None = None) -> Request:
        if request.request_id in self.scheduler.requests and (
            request.request_id not in self.scheduler.migrating  # a parked copy may come back
        ):  # a second live copy would share (and lose) the first's params: the step failed
            raise ValueError(f"request {request.request_id} is already running here")
        vocab_size = self.model_config.vocab_size
        if any(not 0 <= t < vocab_size for t in request.prompt_token_ids):
            # caught here, not by isolation: on a GPU an embedding lookup out of range is a
            # device-side assert that no later step survives
            raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
        rope = None
        if self._rope_rule is not None:  # before the scheduler takes it: may raise
            rope = self._rope_rule(request.prompt_token_ids, request.images)
        self.scheduler.add(request)  # raises ValueError when it can never fit
        if rope is not None:
            self._rope[request.request_id] = rope
        self._offered.discard(request.request_id)  # a request back from elsewhere
        self._pixels[request.request_id] = pixel_values or []
        self._sampling[request.request_id] = SamplingSpec(
            request.sampling, request.eos_token_ids, request.num_prompt_tokens
        )
        self._mark_ready(request)
        return request

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self._forget(request_id)

    def finish_stopped(self, request_id: str) -> None:
        """A stop string matched after detokenizing: end the request, free its pages."""
        self.scheduler.finish(request_id, RequestStatus.FINISHED_STOPPED)
        self.abort(request_id)

    def pull_done(self, request_id: str, output_token_ids: list[int] | None = None) -> None:
        """A migrated-in request's pages have landed: it can be scheduled. ``output_token_ids``:
        its output as the source left it (an early hand-off learns it only now)."""
        request = self.scheduler.requests.get(request_id)
        if output_token_ids is not None and request is not None:
            request.output_token_ids = list(output_token_ids)
        self.scheduler.pull_done(request_id)

    def pull_failed(self, request_id: str) -> bool:
        """Its pull failed; True when it will be recomputed here instead."""
        return self.scheduler.pull_failed(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def step(self) -> tuple[list[RequestEvent], StepStats]:
        """Run one iteration. With ``async_scheduling`` it may be left in flight: the events
        returned are then those of the step before it (``engine_inflight.py``)."""
        start = time.monotonic()
        out = self.scheduler.schedule()
        stats = StepStats(0.0, out.num_batched_tokens, out.num_images, len(out.decodes))
        stats.add_phase(SCHEDULE, time.monotonic() - start)
        stats.pulls = out.pulls
        stats.evicted_ids = out.evicted_ids
        stats.num_preempted = len(out.preempted_ids)
        stats.idle = out.is_empty and not out.evicted_ids and not out.preempted_ids
        stats.idle &= self._inflight is None
        self._note_stage_starts(out, stats, start)
        try:
            if self._may_stay_in_flight(out):
                events, done = self._step_ahead(out, stats)
            else:
                events, done = self._step_now(out, stats)
        except BaseException as exc:
            self._inflight = None  # the caller fails what was in it
            if (error := sticky_device_error(exc)) is not None:
                self.health.fail(f"device error: {error}")
            raise
        now = time.monotonic()
        for request_id in done:
            request = self.scheduler.requests.get(request_id) or self.scheduler.migrating.get(
                request_id
            )
            self._close_stages(request_id, request, now, stats)
        for event in events:
            if event.finish_reason is not None:
                self._forget(event.request_id)
        for request in self.scheduler.running:
            self._mark_ready(request)
        stats.duration_s = time.monotonic() - start
        stats.add_phase(UPDATE, stats.duration_s - sum(stats.phases.values()))
        return events, stats

    def _step_now(
        self, out: SchedulerOutput, stats: StepStats
    ) -> tuple[list[RequestEvent], set[str]]:
        """Run ``out`` and wait for its tokens (after the step in flight, if any)."""
        events, done = self._resolve_inflight(stats)
        if done:  # its tokens are this step's inputs; requests it ended run no more
            ended = {e.request_id for e in events if e.finish_reason is not None}
            out = without_requests(out, ended)
            self._settle_pending(out)
        sampled, stats.failed = self._execute_isolated(out, stats)
        if stats.failed:  # those requests end here; the rest of the batch goes on
            out = without_requests(out, stats.failed.keys())
            for request_id in stats.failed:
                self.abort(request_id)
        now_events = self.scheduler.update(out, {rid: s.token_id for rid, s in sampled.items()})
        events += [_with_logprobs(event, sampled.get(event.request_id)) for event in now_events]
        return events, done | set(requests_in(out))

    def _step_ahead(
        self, out: SchedulerOutput, stats: StepStats
    ) -> tuple[list[RequestEvent], set[str]]:
        """Launch ``out``, update the scheduler provisionally, then resolve the step before."""
        launch_start = time.monotonic()
        try:
            launched = self.runner.launch(out, [], self._sampling, None, self._rope)
        except Exception:
            log.exception("launching a step ahead failed; running it synchronously")
            return self._step_now(out, stats)
        stats.add_phase(LAUNCH, time.monotonic() - launch_start)
        sampled_ids = launched.request_ids
        requests = {rid: self.scheduler.requests[rid] for rid in sampled_ids}
        provisional = self.scheduler.update(out, dict.fromkeys(sampled_ids, PENDING_TOKEN))
        step = InflightStep(
            out,
            launched,
            requests,
            {event.request_id: event for event in provisional},
            {rid: len(r.output_token_ids) - 1 for rid, r in requests.items()},
        )
        events, done = self._resolve_inflight(stats)
        self._inflight = step
        return events, done

    def _may_stay_in_flight(self, out: SchedulerOutput) -> bool:
        """A step can be left in flight when its tokens stay on this instance (a role that
        decodes), it encodes nothing (the image cache is read next step) and no request
        wants logprobs (read back at once)."""
        if not self.config.async_scheduling or not self.config.role.decodes:
            return False
        if out.encodes or not out.token_tasks:
            return False
        sampling = self._sampling
        return not any(sampling[t.request_id].params.logprobs for t in out.token_tasks if t.sample)

    def _resolve_inflight(self, stats: StepStats) -> tuple[list[RequestEvent], set[str]]:
        """The step in flight's events (waits for its tokens), and its requests."""
        step, self._inflight = self._inflight, None
        if step is None:
            return [], set()
        wait_start = time.monotonic()
        step.launched.result()
        stats.add_phase(WAIT, time.monotonic() - wait_start)
        return resolve(step, self.scheduler), step.request_ids

    def _settle_pending(self, out: SchedulerOutput) -> None:
        """Tasks scheduled while their last token was in flight get it on the host."""
        for task in out.token_tasks:
            if task.token_ids[-1] == PENDING_TOKEN:
                request = self.scheduler.requests[task.request_id]
                position = task.start_position + task.num_tokens - 1
                task.token_ids[-1] = request.token_id_at(position)

    def _execute(self, out: SchedulerOutput, stats: StepStats) -> dict[str, SampledToken]:
        launch_start = time.monotonic()
        pixels = [self._pixels[t.request_id][t.image_index] for t in out.encodes]
        launched = self.runner.launch(
            out, pixels, self._sampling, self._watch_prefills(out), self._rope
        )
        wait_start = time.monotonic()
        sampled = launched.result()
        stats.add_phase(LAUNCH, wait_start - launch_start)
        stats.add_phase(WAIT, time.monotonic() - wait_start)
        return sampled

    def _execute_isolated(
        self, out: SchedulerOutput, stats: StepStats
    ) -> tuple[dict[str, SampledToken], dict[str, str]]:
        """Run the batch; when it raises, run each request alone, so that a request the step
        cannot take fails alone (one request's bad seed once failed all 32 in its batch). A
        sticky device error is raised at once: the device fails every later step alike.

        Re-running is safe: encodes and prefills write the same pages again, and a seeded
        draw depends only on its seed and position. Returns the sampled tokens and the
        requests that failed on their own, with the message their clients get."""
        try:
            return self._execute(out, stats), {}
        except Exception as exc:
            if sticky_device_error(exc) is not None:
                raise  # not the batch's fault: every request would fail alone the same way
            request_ids = requests_in(out)
            if len(request_ids) == 1:
                log.exception("engine step failed for request %s", request_ids[0])
                return {}, {request_ids[0]: REQUEST_FAILED}
            log.exception("engine step of %d requests failed; running each alone", len(request_ids))
        sampled: dict[str, SampledToken] = {}
        failed: dict[str, str] = {}
        for request_id in request_ids:
            try:
                sampled.update(self._execute(only_request(out, request_id), stats))
            except Exception as exc:
                if sticky_device_error(exc) is not None:
                    raise
                log.exception("request %s fails the engine step", request_id)
                failed[request_id] = REQUEST_FAILED
        return sampled, failed

    def _watch_prefills(self, out: SchedulerOutput) -> LayerWritten | None:
        """On an instance that does not decode, every prefill's KV migrates next."""
        if self.watch_prefill is None or not out.prefills or self.config.role.decodes:
            return None
        requests = self.scheduler.requests
        return self.watch_prefill([(requests[t.request_id], t) for t in out.prefills])

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
                self._stage_started[key] = (now, now - ready)
                stats.queue_waits.append((key[1], now - ready))

    def _close_stages(
        self, request_id: str, request: Request | None, now: float, stats: StepStats
    ) -> None:
        """Report stages the request has left behind (or all, once it is done here)."""
        current = None if request is None or request.status.finished else request.next_stage
        for stage in _STAGES:
            if stage is current:
                continue
            started = self._stage_started.pop((request_id, stage), None)
            if started is not None:
                start_s, queue_s = started
                stats.stage_timings.append(
                    StageTiming(request_id, stage, queue_s, now - start_s, start_s - queue_s, now)
                )
                self._stage_reported.add((request_id, stage))

    def _mark_ready(self, request: Request) -> None:
        key = (request.request_id, request.next_stage)
        if not (
            key in self._stage_started or key in self._stage_ready_s or key in self._stage_reported
        ):
            self._stage_ready_s[key] = time.monotonic()

    # ---- migration (DESIGN.md §4) -----------------------------------------------------
    def take_handoffs(self) -> list[Request]:
        """Requests that finished their local stages since the last call: offer them."""
        fresh = [r for rid, r in self.scheduler.migrating.items() if rid not in self._offered]
        self._offered.update(r.request_id for r in fresh)
        return fresh

    def release_migrated(self, request_id: str) -> None:
        """Step 4 on the source: the target has the pages."""
        if self.scheduler.release_migrated(request_id):
            self._offered.discard(request_id)
            self._forget(request_id)

    def exposed_pages(self, request_id: str) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
        """Step 1 on the source: a parked request's pages a target will pull -- per image in
        prompt order, and the KV pages that hold its computed tokens."""
        request = self.scheduler.migrating.get(request_id)
        if request is None:
            raise KeyError(request_id)
        sched = self.scheduler
        images = tuple(
            tuple(slot.blocks) for slot in (sched.images.slots(request_id) if sched.images else [])
        )
        kv: tuple[int, ...] = ()
        if sched.kv is not None:
            used = -(-request.num_computed_tokens // self.config.kv_block_size)
            kv = tuple(sched.kv.block_table(request_id)[:used])
        staging = self.runner.staging
        if staging is not None and kv and request.next_stage is not Stage.PREFILL:
            # a tensor-parallel source: peers read whole heads from staging pages
            staged = staging.stage(request_id, kv)
            staging.gather(kv, staged)
            kv = staged
        return images, kv

    @property
    def num_layers(self) -> int:
        return self.model_config.num_layers

    def _forget(self, request_id: str) -> None:
        if self.on_forget is not None:
            self.on_forget(request_id)
        if self.runner.staging is not None:
            self.runner.staging.release(request_id)
        self._pixels.pop(request_id, None)
        self._sampling.pop(request_id, None)
        self._rope.pop(request_id, None)
        for stage in Stage:
            self._stage_ready_s.pop((request_id, stage), None)
            self._stage_started.pop((request_id, stage), None)
            self._stage_reported.discard((request_id, stage))


REQUEST_FAILED = "internal engine error: the engine could not run this request"


def requests_in(out: SchedulerOutput) -> list[str]:
    """Every request with work in ``out``, in order of first appearance."""
    ids = [t.request_id for t in out.encodes] + [t.request_id for t in out.token_tasks]
    return list(dict.fromkeys(ids))


def only_request(out: SchedulerOutput, request_id: str) -> SchedulerOutput:
    """The work of one request in ``out`` (what the runner executes; no pulls)."""
    return SchedulerOutput(
        encodes=[t for t in out.encodes if t.request_id == request_id],
        prefills=[t for t in out.prefills if t.request_id == request_id],
        decodes=[t for t in out.decodes if t.request_id == request_id],
    )


def without_requests(out: SchedulerOutput, request_ids: Iterable[str]) -> SchedulerOutput:
    """``out`` less the work of ``request_ids`` (ended while the step ran)."""
    gone = set(request_ids)
    return replace(
        out,
        encodes=[t for t in out.encodes if t.request_id not in gone],
        prefills=[t for t in out.prefills if t.request_id not in gone],
        decodes=[t for t in out.decodes if t.request_id not in gone],
    )


def _with_logprobs(event: RequestEvent, sampled: SampledToken | None) -> RequestEvent:
    if sampled is None or sampled.logprobs is None or event.new_token_id is None:
        return event
    return replace(event, logprobs=sampled.logprobs)
