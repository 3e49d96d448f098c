"""``create_emulated_app(settings)``: an emulated instance's app (no torch, no FastAPI:
``emulate/http.py`` says why)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from epd_engine.config import SLO, Role, internal_token
from epd_engine.contracts.plan import Budgets
from epd_engine.emulate import EMULATED_NOTE, emulated_name, router_side
from epd_engine.emulate.costs import EmulatedCosts
from epd_engine.emulate.engine import EmulatedEngine
from epd_engine.emulate.http import EXCEPTION_HANDLERS, route
from epd_engine.emulate.instance_metrics import InstanceMetrics
from epd_engine.emulate.loop import EmulatedLoop
from epd_engine.emulate.migration import ROUTES as MIGRATION_ROUTES
from epd_engine.emulate.migration import EmulatedMigration
from epd_engine.emulate.routes import ROUTES as OPENAI_ROUTES
from epd_engine.emulate.routes import EmulatedState
from epd_engine.engine import startup
from epd_engine.metrics import Metrics


@dataclass(frozen=True)
class EmulatedSettings:
    costs: EmulatedCosts
    model_name: str  # as given; served with EMULATED_SUFFIX
    role: Role = Role.EPD
    pool: str = "local"
    slo: SLO = field(default_factory=SLO)
    budgets: Budgets | None = None  # None: derived from the cost model against the SLO
    router_url: str | None = None  # set: register with this router and serve its requests
    advertise_url: str = "http://127.0.0.1:8000"  # how the router reaches this instance
    instance_id: str = ""


def create_emulated_app(settings: EmulatedSettings) -> Starlette:
    # built here, not in the lifespan: a bad cost model or an SLO no batch meets fails the
    # command at once, with its message
    engine = EmulatedEngine(settings.role, settings.costs, settings.slo, settings.budgets)
    startup.mark("budgets")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        name = emulated_name(settings.model_name)
        metrics = Metrics(name, settings.role.value, settings.pool)
        loop = EmulatedLoop(engine, InstanceMetrics(metrics, engine))
        state = EmulatedState(name, loop, metrics, settings.slo)
        app.state.emulated = state
        loop.start()
        startup.mark("engine_built")
        async with httpx.AsyncClient() as http:
            if settings.router_url is not None:
                state.link = router_side.connect(
                    settings.router_url, settings.advertise_url, settings.instance_id,
                    settings.role, settings.pool, engine, http,
                )  # fmt: skip
                state.migration = EmulatedMigration(
                    loop, state.link, loop.metrics, state.relays, http, internal_token()
                )
            state.ready = True
            startup.mark("serving")
            try:
                yield
            finally:
                state.ready = False
                if state.migration is not None:
                    await state.migration.close()
                if state.link is not None:
                    await state.link.stop()
                await loop.stop()

    async def live(_: Request) -> dict[str, str]:
        return {"status": "alive"}

    async def ready(request: Request) -> dict[str, object] | Response:
        state: EmulatedState | None = getattr(request.app.state, "emulated", None)
        if state is None or not state.ready:
            return JSONResponse({"status": "starting"}, 503)
        budgets = engine.budgets
        return {
            "status": "ready",
            "role": settings.role.value,
            "model": state.model_name,
            "emulated": {"cost_model": settings.costs.source, "note": EMULATED_NOTE},
            "startup": startup.timeline(),
            "budgets": {"token_budget": budgets.token_budget, "image_budget": budgets.image_budget},
        }

    async def metrics(request: Request) -> Response:
        state: EmulatedState = request.app.state.emulated
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    routes = [
        *OPENAI_ROUTES,
        *router_side.ROUTES,
        *MIGRATION_ROUTES,
        route("/health/live", live),
        route("/health/ready", ready),
        route("/metrics", metrics),
    ]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers=EXCEPTION_HANDLERS)
