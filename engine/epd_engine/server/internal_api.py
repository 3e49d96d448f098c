"""Internal endpoints (router submit, migration steps). Need the shared ``X-EPD-Token``."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from epd_engine.api.auth import require_token
from epd_engine.api.completions import CompletionRequest
from epd_engine.api.protocol import ChatCompletionRequest
from epd_engine.cache.trace_blocks import TRACE_BLOCK_TOKENS, trace_hash_ids
from epd_engine.contracts.errors import ClientError
from epd_engine.engine.async_engine import RequestOutputStream
from epd_engine.engine.detokenizer import Detokenizer
from epd_engine.inputs.chat import prepare
from epd_engine.server.state import InstanceState
from epd_engine.transfer.backend import TransferError
from epd_engine.transfer.messages import MigrationOffer, Routing


class NotFound(ClientError):
    status_code = 404
    error_type = "not_found_error"


router = APIRouter(prefix="/internal", dependencies=[Depends(require_token)])


def _state(request: Request) -> InstanceState:
    state: InstanceState = request.app.state.instance
    return state


class SubmitRequest(BaseModel):
    """The router hands a client request to its entry instance."""

    routing: Routing
    body: ChatCompletionRequest | CompletionRequest
    resume_output_token_ids: list[int] = Field(default_factory=list)
    emitted_text: str = ""


@router.post("/requests")
async def submit(payload: SubmitRequest, request: Request) -> dict[str, object]:
    state = _state(request)
    link = state.link
    if link is None:
        raise ClientError("this instance has no router link")
    engine = state.engine
    prompt, params = await prepare(
        payload.body,
        state.processor,
        state.http,
        state.config,
        engine.engine.max_model_len,
        state.preprocess,
    )
    routing = payload.routing.model_copy(update={"whole_answer": not payload.body.stream})
    detokenizer = Detokenizer.resume(
        engine.decode,
        params.stop,
        payload.resume_output_token_ids,
        payload.emitted_text,
        params.min_tokens,
        routing.whole_answer,
    )
    stream = RequestOutputStream(
        sink=lambda output: link.send(output, routing),
        loop=asyncio.get_running_loop(),
        detokenizer=detokenizer,
        num_prompt_tokens=len(prompt.token_ids),
        num_output_tokens=len(payload.resume_output_token_ids),
        routing=routing,
    )
    request_id = f"{routing.router_request_id}-{routing.attempt}"
    await engine.add(
        lambda: engine.engine.add_request(
            request_id,
            prompt,
            params,
            state.processor.eos_token_ids,
            resume_output_token_ids=payload.resume_output_token_ids,
        ),
        stream,
    )
    image_tokens = sum(i.num_tokens for i in prompt.images)
    return {
        "request_id": request_id,
        "prompt_tokens": len(prompt.token_ids) - image_tokens,
        "images": [
            {
                "tokens": i.num_tokens,
                "hash": i.content_hash,
                "width": i.width,
                "height": i.height,
                "offset": i.offset,
            }
            for i in prompt.images
        ],
        # the prompt's prefix identity, for the router's trace (cache/trace_blocks.py)
        "hash_ids": trace_hash_ids(prompt.token_ids, prompt.images),
        "hash_block_tokens": TRACE_BLOCK_TOKENS,
    }


class AbortRequest(BaseModel):
    attempt: int


@router.post("/requests/{router_request_id}/abort")
async def abort(router_request_id: str, body: AbortRequest, request: Request) -> dict[str, bool]:
    """The router's client went away (or gave up): stop the request and free its pages now
    (they once stayed held until the request ran to its end)."""
    state = _state(request)
    request_id = f"{router_request_id}-{body.attempt}"
    engine = state.engine

    def stop() -> bool:
        if request_id not in engine.streams:
            return False
        engine.abort(request_id)
        return True

    held = bool(await engine.call_async(stop))
    if state.migration is not None and request_id in state.migration.source.handed_to:
        state.migration.source.release(request_id)  # pages parked for a target that need not pull
        held = True
    if held:
        state.metrics.requests.labels(**state.metrics.labels, outcome="aborted").inc()
    return {"aborted": held}


@router.post("/migrations")
async def offer(offer: MigrationOffer, request: Request) -> dict[str, str]:
    state = _state(request)
    if state.migration is None:
        raise ClientError("this instance has no router link")
    await state.migration.target.accept(offer)
    return {"status": "queued"}


@router.post("/transfer/{backend}/{op}")
async def transfer_control(
    backend: str, op: str, body: dict[str, Any], request: Request
) -> dict[str, Any]:
    """A peer's control message for our transfer backend (collective: connect, send)."""
    state = _state(request)
    if state.migration is None:
        raise ClientError("this instance has no router link")
    if backend not in state.migration.backend.describe():
        raise ClientError(f"this instance does not serve the {backend} transfer backend")
    try:
        return await state.migration.backend.control(op, body)
    except TransferError as exc:
        raise ClientError(str(exc), code="transfer_refused") from exc


@router.get("/migrations/{request_id}/progress")
async def progress(request_id: str, request: Request, after: int = -1) -> dict[str, Any]:
    """Long-poll of an early offer's target: answers once the prefill progressed past
    ``after`` (a version it saw), or after a while unchanged."""
    state = _state(request)
    if state.migration is None:
        raise ClientError("this instance has no router link")
    answer = await state.migration.source.progress(request_id, after)
    if answer is None:
        raise NotFound(f"no request {request_id} offered early here")
    return answer.model_dump(mode="json")


@router.post("/migrations/{request_id}/release")
async def release(request_id: str, request: Request) -> dict[str, str]:
    state = _state(request)
    assert state.migration is not None
    state.migration.source.release(request_id)
    return {"status": "released"}
