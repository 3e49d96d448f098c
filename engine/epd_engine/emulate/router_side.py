"""An emulated instance behind the real router: registration and heartbeats through the
engine's own ``RouterLink`` (its load read off the real scheduler), the router's submit and
abort routes; each request's events go on the link's event stream (``relay.py``)."""

from __future__ import annotations

import httpx
from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.routing import Route

from epd_engine.api.protocol import ChatCompletionRequest
from epd_engine.cache.trace_blocks import TRACE_BLOCK_TOKENS, trace_hash_ids
from epd_engine.config import Role, internal_token, placement_group
from epd_engine.contracts.errors import ClientError
from epd_engine.contracts.host import host_id
from epd_engine.contracts.routing_policy import InstanceLoad
from epd_engine.disagg.router_directory import RouterDirectory, split_urls
from epd_engine.disagg.router_link import RouterLink
from epd_engine.emulate.engine import EmulatedEngine
from epd_engine.emulate.http import route
from epd_engine.emulate.loop import EmulatedLoop
from epd_engine.emulate.prompts import chat_request
from epd_engine.emulate.relay import start_relay
from epd_engine.emulate.tokens import token_text
from epd_engine.engine.health import EngineHealth
from epd_engine.transfer.messages import Routing


class LoadSource:
    """What ``RouterLink.load`` reads off an engine: its scheduler and its health."""

    def __init__(self, engine: EmulatedEngine) -> None:
        self.scheduler = engine.scheduler
        self.health = EngineHealth(None)  # no device to fail, no engine thread to stall


def connect(
    router_url: str, advertise_url: str, instance_id: str, role: Role, pool: str,
    engine: EmulatedEngine, http: httpx.AsyncClient,
) -> RouterLink:  # fmt: skip
    identity = InstanceLoad(
        instance_id=instance_id or advertise_url,
        url=advertise_url,
        role=role,
        pool=pool,
        node=host_id(),
        group=placement_group(),
    )
    directory = RouterDirectory(split_urls([router_url]))
    link = RouterLink(directory, identity, http, internal_token(), token_text=token_text)
    link.start(LoadSource(engine))  # type: ignore[arg-type]  # reads .scheduler and .health
    return link


class SubmitRequest(BaseModel):
    """The router's submit (``server/internal_api.SubmitRequest``; chat bodies only here)."""

    routing: Routing
    body: ChatCompletionRequest
    resume_output_token_ids: list[int] = Field(default_factory=list)
    emitted_text: str = ""


class AbortRequest(BaseModel):
    attempt: int


async def submit(request: Request, payload: SubmitRequest) -> dict[str, object]:
    state = request.app.state.emulated
    link: RouterLink | None = state.link
    if link is None:
        raise ClientError("this instance has no router link")
    loop: EmulatedLoop = state.loop
    routing = payload.routing
    request_id = f"{routing.router_request_id}-{routing.attempt}"
    engine_request = chat_request(request_id, payload.body, loop.engine.tokens_per_image)
    if state.migration is not None:  # its next stage may run on another instance
        state.migration.follow(request_id, routing)
    events = loop.generate(engine_request)
    try:
        # admission errors are the router's 400; None: handed off before any token (E)
        first = await anext(events, None)
    except ValueError as exc:
        raise ClientError(str(exc)) from exc
    num_prompt = engine_request.num_prompt_tokens
    on_end = state.migration.ended if state.migration is not None else None
    start_relay(
        state.relays, link, state.metrics, routing, request_id, events, first, num_prompt,
        on_end=on_end,
    )  # fmt: skip
    image_tokens = sum(i.num_tokens for i in engine_request.images)
    return {
        "request_id": request_id,
        "prompt_tokens": engine_request.num_prompt_tokens - image_tokens,
        "images": [
            {
                "tokens": i.num_tokens,
                "hash": i.content_hash,
                "width": 1,  # no image is decoded here: its size is unknown (the
                "height": 1,  # router's trace record needs one), its tokens are the model's
                "offset": i.offset,
            }
            for i in engine_request.images
        ],
        "hash_ids": trace_hash_ids(engine_request.prompt_token_ids, engine_request.images),
        "hash_block_tokens": TRACE_BLOCK_TOKENS,
    }


async def abort(request: Request, body: AbortRequest) -> dict[str, bool]:
    router_request_id = request.path_params["router_request_id"]
    task = request.app.state.emulated.relays.get(f"{router_request_id}-{body.attempt}")
    if task is None:
        return {"aborted": False}
    task.cancel()  # its relay closes the request's events, which aborts it in the scheduler
    metrics = request.app.state.emulated.metrics
    metrics.requests.labels(**metrics.labels, outcome="aborted").inc()
    return {"aborted": True}


ROUTES: list[Route] = [
    route("/internal/requests", submit, "POST", body=SubmitRequest, internal=True),
    route("/internal/requests/{router_request_id}/abort", abort, "POST", body=AbortRequest,
          internal=True),
]  # fmt: skip
