"""Liveness (the process answers and its engine can serve) and readiness (model loaded,
engine thread running). Both answer 503 once the instance is out of service for good (a
sticky device error, a stuck engine thread: ``engine/health.py``), so the kubelet restarts
it; the reason is in the answer."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from epd_engine.engine import startup
from epd_engine.server.state import InstanceState

router = APIRouter()


def _out_of_service(state: InstanceState | None, response: Response) -> dict[str, str] | None:
    reason = state.engine.unhealthy_reason() if state is not None else None
    if reason is None:
        return None
    response.status_code = 503
    return {"status": "out_of_service", "reason": reason}


@router.get("/health/live")
async def live(request: Request, response: Response) -> dict[str, str]:
    state: InstanceState | None = getattr(request.app.state, "instance", None)
    return _out_of_service(state, response) or {"status": "alive"}


@router.get("/health/ready")
async def ready(request: Request, response: Response) -> dict[str, object]:
    state: InstanceState = request.app.state.instance
    if (broken := _out_of_service(state, response)) is not None:
        return dict(broken)
    if not state.ready:
        response.status_code = 503
        return {"status": "starting"}
    return {
        "status": "ready",
        "role": state.config.role.value,
        "model": state.config.model_name,
        "startup": startup.timeline(),  # when each start-up phase ended (epoch seconds)
        # budgets this instance searched at start ({} when all were given): the same role
        # with the same flags can be started with them (``--token-budget``,
        # ``--image-token-budget``) and skip the search
        "searched_budgets": state.engine.engine.searched_budgets,
        # start-up objects frozen out of the garbage collector's passes (gc_heap)
        "gc_frozen_objects": state.frozen_objects,
    }


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state: InstanceState = request.app.state.instance
    if state.gpu is not None:
        state.gpu.publish()  # read at scrape time: memory, utilisation, power
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
