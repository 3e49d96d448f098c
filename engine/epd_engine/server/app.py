"""``create_app(settings)``: the engine instance's FastAPI app."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI

from epd_engine.api.errors import install_error_handlers
from epd_engine.api.limits import BodySizeLimit
from epd_engine.api.logprobs import token_text_of
from epd_engine.config import EngineConfig, internal_token, placement_group
from epd_engine.contracts.host import host_id
from epd_engine.contracts.routing_policy import InstanceLoad
from epd_engine.disagg.hooks import AsyncEngineHooks
from epd_engine.disagg.migration import Migration
from epd_engine.disagg.router_directory import RouterDirectory, split_urls
from epd_engine.disagg.router_link import RouterLink
from epd_engine.engine.async_engine import AsyncEngine
from epd_engine.engine.gc_heap import freeze_startup_heap
from epd_engine.engine.llm_engine import LLMEngine, StepStats, startup
from epd_engine.engine.step_phases import step_kind
from epd_engine.inputs.preprocess_pool import PreprocessPool
from epd_engine.inputs.processor import InputProcessor
from epd_engine.metrics import Metrics
from epd_engine.server import health, internal_api, openai_api
from epd_engine.server.cache_counters import CacheCounters
from epd_engine.server.gpu_metrics import GpuMetrics
from epd_engine.server.state import InstanceState
from epd_engine.transfer.backend import Exports
from epd_engine.transfer.factory import TransferSettings, cache_memory, make_backend
from epd_engine.transfer.memory import CacheMemory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSettings:
    engine: EngineConfig
    pool: str = "local"
    # set: register with this router (a comma list: each replica) and serve its requests
    router_url: str | None = None
    resolve_router_replicas: bool = False  # each router URL's host lists every replica (DNS)
    advertise_url: str = "http://127.0.0.1:8000"  # how the router and peers reach us
    instance_id: str = ""
    bind_host: str = "127.0.0.1"  # the interface the HTTP server (and tcp page server) use
    transfer_backend: str = "auto"
    transfer_port: int = 0  # tcp page server; 0 picks a free port (peers learn it per offer)
    kv_layers_per_group: int = 8  # KV moves in layer groups so transfer can overlap compute
    early_kv: bool = True  # offer KV when prefill starts and move groups as they are written

    def transfer(self) -> TransferSettings:
        return TransferSettings(
            backend=self.transfer_backend,
            bind_host=self.bind_host,
            advertise_host=urlsplit(self.advertise_url).hostname or "127.0.0.1",
            tcp_port=self.transfer_port,
        )


def _step_recorder(metrics: Metrics, engine: LLMEngine):
    labels = metrics.labels
    scheduler = engine.scheduler
    last_hits = last_lookups = 0

    cache_counters = CacheCounters(metrics, scheduler)

    def record(stats: StepStats) -> None:
        nonlocal last_hits, last_lookups
        cache_counters.record()
        metrics.batch_tokens.labels(**labels).observe(stats.num_tokens)
        if stats.num_decodes:
            metrics.batch_decodes.labels(**labels).observe(stats.num_decodes)
        if stats.num_images:
            metrics.batch_images.labels(**labels).observe(stats.num_images)
        for stage in stats.stages:
            metrics.stage_execution.labels(**labels, stage=stage.value).observe(stats.duration_s)
        kind = step_kind(stats.num_tokens, stats.num_decodes, stats.num_images)
        for phase, seconds in stats.phases.items():
            metrics.step_phase.labels(**labels, phase=phase, step=kind).observe(seconds)
        for stage, wait_s in stats.queue_waits:
            metrics.stage_queue.labels(**labels, stage=stage.value).observe(wait_s)
        if stats.num_preempted:
            metrics.preemptions.labels(**labels, action="recompute").inc(stats.num_preempted)
        if stats.evicted_ids:
            metrics.preemptions.labels(**labels, action="reroute").inc(len(stats.evicted_ids))
        metrics.running.labels(**labels).set(len(scheduler.running))
        metrics.waiting.labels(**labels).set(len(scheduler.waiting))
        if scheduler.kv is not None:
            kv = scheduler.kv.pool
            metrics.cache_usage.labels(**labels, cache="kv").set(kv.usage)
            metrics.cache_used_pages.labels(**labels, cache="kv").set(kv.num_used)
        if scheduler.images is not None:
            images = scheduler.images
            metrics.cache_usage.labels(**labels, cache="image").set(images.pool.usage)
            metrics.cache_used_pages.labels(**labels, cache="image").set(images.pool.num_used)
            metrics.encoder_cache_hits.labels(**labels).inc(images.num_hits - last_hits)
            metrics.encoder_cache_lookups.labels(**labels).inc(images.num_lookups - last_lookups)
            last_hits, last_lookups = images.num_hits, images.num_lookups

    return record


def _publish_capacity(metrics: Metrics, engine: LLMEngine) -> None:
    """The caches' sizes (fixed at start), and nothing used yet."""
    scheduler = engine.scheduler
    for cache, manager in (("kv", scheduler.kv), ("image", scheduler.images)):
        if manager is not None:
            metrics.cache_capacity_pages.labels(**metrics.labels, cache=cache).set(
                manager.pool.num_blocks
            )
            metrics.cache_used_pages.labels(**metrics.labels, cache=cache).set(
                manager.pool.num_used
            )


def _connect_router(
    settings: ServerSettings, state: InstanceState, memory: CacheMemory
) -> RouterLink:
    assert settings.router_url is not None
    identity = InstanceLoad(
        instance_id=settings.instance_id or settings.advertise_url,
        url=settings.advertise_url,
        role=settings.engine.role,
        pool=settings.pool,
        node=host_id(),  # peers on this machine get our caches through shared memory
        group=placement_group(),  # peers in our pod (epdctl group) get them first
    )
    token = internal_token()
    token_text = token_text_of(state.processor.tokenizer)
    routers = RouterDirectory(split_urls([settings.router_url]), settings.resolve_router_replicas)
    link = RouterLink(routers, identity, state.http, token, token_text=token_text)
    exports = Exports()
    regions = state.engine.engine.runner.regions
    backend = make_backend(settings.transfer(), memory, regions, exports, state.http, token)
    state.link = link  # the app's: its routes send on it, migration uses it
    state.migration = Migration(
        AsyncEngineHooks(state.engine),
        link,
        backend,
        exports,
        state.http,
        token,
        settings.kv_layers_per_group,
        # a tensor-parallel source gathers a request's pages from its ranks once prefill
        # has ended (parallel/kv_staging.py), so it does not offer them layer by layer
        early_kv=settings.early_kv and state.engine.engine.runner.staging is None,
        metrics=state.metrics,
    )
    return link


def _preprocess_pool(config: EngineConfig, engine: LLMEngine) -> PreprocessPool | None:
    """The worker processes for preprocessing, started (each loads the processor) before
    the instance reports ready; None when it preprocesses in its own process."""
    if not config.preprocess_workers:
        return None
    pool = PreprocessPool(config.model_dir, engine.model_config, config.preprocess_workers)
    pool.warm_up()
    return pool


def create_app(settings: ServerSettings, freeze_heap: bool = False) -> FastAPI:
    """``freeze_heap``: the app is its process's server (``epdctl serve``), so the objects
    start-up made are frozen out of the garbage collector's passes once it is ready; apps
    that share a process (tests) leave that process's heap alone."""
    config = settings.engine

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics = Metrics(config.model_name, config.role.value, settings.pool)
        transfer = settings.transfer() if settings.router_url else None
        memory = cache_memory(transfer.backend, config.device) if transfer else None
        engine = LLMEngine(config, memory)
        processor = InputProcessor(config.model_dir, engine.model_config)
        async_engine = AsyncEngine(engine, processor.decode, _step_recorder(metrics, engine))
        _publish_capacity(metrics, engine)
        preprocess = _preprocess_pool(config, engine)
        startup.mark("engine_built")
        async with httpx.AsyncClient() as http:
            state = InstanceState(config, async_engine, processor, metrics, http)
            state.preprocess = preprocess
            state.gpu = GpuMetrics.for_device(metrics, config.device)
            app.state.instance = state
            link = _connect_router(settings, state, memory) if memory is not None else None
            async_engine.start()
            watchdog = asyncio.create_task(_watch(async_engine, engine))
            if link is not None:
                link.start(engine)
            if freeze_heap:  # last, once start-up's objects are all made (gc_heap)
                state.frozen_objects = freeze_startup_heap()
            state.ready = True
            startup.mark("serving")
            log.info("serving %s as %s", config.model_name, config.role.value)
            try:
                yield
            finally:
                state.ready = False
                watchdog.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watchdog
                if link is not None:
                    await link.stop()
                if state.migration is not None:
                    await state.migration.close()
                async_engine.stop()
                if preprocess is not None:
                    preprocess.close()

    # no generated API docs: they listed every internal route and its schema to anyone
    app = FastAPI(
        title="EPD engine instance",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_bytes)
    app.include_router(openai_api.router)
    app.include_router(health.router)
    app.include_router(internal_api.router)
    return app


RANKS_LOST_EXIT = 75  # EX_TEMPFAIL: the tensor-parallel ranks fell apart; start again
RANKS_LOST_GRACE_S = 2.0


async def _watch(async_engine: AsyncEngine, engine: LLMEngine) -> None:
    """``AsyncEngine.watch``; then, when the instance went out of service because its
    tensor-parallel ranks fell apart, exit: a lost rank cannot come back in place, and an
    exit is what every supervisor (the kubelet, ``epdctl up``) restarts at once. The grace
    lets this instance's clients and router read their errors first."""
    await async_engine.watch()
    ranks = engine.ranks
    if ranks is None or ranks.lost is None:
        return
    await asyncio.sleep(RANKS_LOST_GRACE_S)
    log.error("exiting to be restarted: %s", ranks.lost)
    ranks.kill()
    logging.shutdown()
    os._exit(RANKS_LOST_EXIT)
