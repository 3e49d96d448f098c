"""``create_app(settings)``: the router's FastAPI app."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from epd_engine.api.errors import install_error_handlers
from epd_engine.api.limits import BodySizeLimit
from epd_engine.config import internal_token
from epd_engine.engine.gc_heap import freeze_startup_heap
from epd_engine.metrics import Metrics
from epd_engine.router import client_api, internal_api
from epd_engine.router.dispatch import Dispatcher
from epd_engine.router.keepalive_client import KeepAliveClient
from epd_engine.router.plan_info import plan_labels, publish_plan
from epd_engine.router.readiness import readiness
from epd_engine.router.registry import Registry
from epd_engine.router.settings import RouterSettings
from epd_engine.router.trace_recorder import TraceRecorder


def create_app(settings: RouterSettings, freeze_heap: bool = False) -> FastAPI:
    """``freeze_heap``: the app is its process's server (``epdctl router``): see the
    instance's ``create_app``."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics = Metrics(settings.model, "router", "router")
        metrics.publish_slo(settings.slo)
        if settings.plan is not None:
            publish_plan(metrics, plan_labels(settings.plan))
        registry = Registry(settings.instance_timeout_s)
        if settings.active_pools is not None:
            registry.active_pools = set(settings.active_pools)
        recorder = TraceRecorder(
            settings.trace_dir, settings.trace_max_bytes, settings.trace_max_files
        )
        http = KeepAliveClient()
        dispatcher = Dispatcher(settings, registry, http, internal_token(), metrics, recorder)
        app.state.dispatcher = dispatcher
        watcher = asyncio.create_task(dispatcher.watch_instances())
        if freeze_heap:  # full collections then skip the start-up objects (gc_heap)
            freeze_startup_heap()
        try:
            yield
        finally:
            watcher.cancel()
            http.close()

    # no generated API docs: they listed every internal route and its schema to anyone
    app = FastAPI(
        title="EPD router",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes)
    app.include_router(client_api.router)
    app.include_router(internal_api.router)

    @app.get("/health/live")
    async def live() -> dict[str, str]:
        return {"status": "alive"}

    started_s = time.monotonic()
    was_ready = False

    @app.get("/health/ready")
    async def ready(request: Request, response: Response) -> dict[str, object]:
        """``router/readiness.py``: an instance that prefills, and at start every pool of
        the routing it started with (until the grace ends or it is Ready once)."""
        nonlocal was_ready
        registry = request.app.state.dispatcher.registry
        waiting = not was_ready and time.monotonic() - started_s < settings.startup_pool_grace_s
        ok, body = readiness(registry.active(), registry.active_pools, waiting)
        was_ready = was_ready or ok
        if not ok:
            response.status_code = 503
        return body

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        registry = request.app.state.dispatcher.metrics.registry
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
