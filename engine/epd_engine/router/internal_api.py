"""Internal router endpoints: heartbeats, instance events, retries, pools and draining."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Header, HTTPException, Request
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from epd_engine.api.auth import require_member, require_token
from epd_engine.contracts.routing_policy import InstanceLoad
from epd_engine.disagg.event_stream import SESSION_HEADER
from epd_engine.router.dispatch import Dispatcher
from epd_engine.router.plan_info import plan_labels, publish_plan

router = APIRouter(prefix="/internal", dependencies=[Depends(require_token)])


def _dispatcher(request: Request) -> Dispatcher:
    dispatcher: Dispatcher = request.app.state.dispatcher
    return dispatcher


@router.post("/instances/heartbeat", dependencies=[Depends(require_member)])
async def heartbeat(beat: InstanceLoad, request: Request) -> dict[str, object]:
    dispatcher = _dispatcher(request)
    if beat.unhealthy_reason:  # out of service for good: out of routing now, its work re-routed
        if (known := dispatcher.registry.get(beat.instance_id)) is not None:
            dispatcher.mark_down(known, f"is out of service: {beat.unhealthy_reason}")
    else:
        dispatcher.registry.heartbeat(beat)
    # the id tells the instance which of its router links owns this replica's requests
    return {
        "router_id": dispatcher.router_id,
        "instances": [i.to_json() for i in dispatcher.registry.active()],
    }


@router.post("/event-stream", dependencies=[Depends(require_member)])
async def event_stream(
    request: Request, session: str = Header(alias=SESSION_HEADER)
) -> dict[str, int]:
    """One instance's events, a line each, applied as they arrive; the answer, when the
    sender ends the stream, acknowledges the last ``seq`` applied."""
    relay = _dispatcher(request).events
    try:
        return {"seq": await relay.consume(session, request.stream())}
    except ClientDisconnect:  # the sender re-sends what we did not acknowledge
        return {"seq": relay.last_seq(session)}


class RetryRequest(BaseModel):
    attempt: int
    reason: str


@router.post("/requests/{router_request_id}/retry")
async def retry(router_request_id: str, body: RetryRequest, request: Request) -> dict[str, str]:
    await _dispatcher(request).retry(router_request_id, body.attempt, body.reason)
    return {"status": "ok"}


@router.get("/pools")
async def pools(request: Request) -> dict[str, object]:
    """Instances and in-flight requests per pool (the operator drains by this)."""
    dispatcher = _dispatcher(request)
    registry = dispatcher.registry
    by_pool: dict[str, dict[str, Any]] = {}
    for load in registry.all():
        pool = by_pool.setdefault(load.pool, {"instances": [], "inflight": 0, "role": load.role})
        pool["instances"].append(load.to_json())
    for inflight in dispatcher.inflight.values():
        holder = registry.get(inflight.holder or "")
        if holder is not None and holder.pool in by_pool:
            by_pool[holder.pool]["inflight"] += 1
    active = registry.active_pools
    return {
        "router_id": dispatcher.router_id,
        "active_pools": sorted(active) if active is not None else None,
        "pools": {
            name: {**info, "role": info["role"].value, "active": active is None or name in active}
            for name, info in by_pool.items()
        },
    }


@router.get("/requests")
async def inflight(request: Request) -> dict[str, object]:
    """Requests in flight: where each one is and where it has been."""
    return {
        "requests": [
            {
                "id": r.router_request_id,
                "holder": r.holder,
                "path": r.path,
                "instances": r.instances,
                "attempt": r.attempt,
                "num_output_tokens": len(r.token_ids),
            }
            for r in _dispatcher(request).inflight.values()
        ]
    }


class Routing(BaseModel):
    active_pools: list[str] | None  # None: every registered pool takes new requests
    plan: dict[str, object] | None = None  # the plan these pools serve (epd_plan_info)


@router.put("/routing")
async def set_routing(body: Routing, request: Request) -> dict[str, object]:
    """Switch new requests to these pools; requests already in others finish there."""
    try:  # check the plan before anything changes
        labels = plan_labels(body.plan) if body.plan is not None else None
    except ValueError as exc:
        raise HTTPException(422, f"plan: {exc}") from exc
    dispatcher = _dispatcher(request)
    registry = dispatcher.registry
    new = set(body.active_pools) if body.active_pools is not None else None
    if new != registry.active_pools:  # a re-sent switch is not another reconfiguration
        dispatcher.metrics.reconfigurations.labels(**dispatcher.metrics.labels).inc()
    registry.active_pools = new
    if labels is not None:
        publish_plan(dispatcher.metrics, labels)
    return {"active_pools": body.active_pools}
