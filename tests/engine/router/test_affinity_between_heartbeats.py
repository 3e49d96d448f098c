"""A conversation's turns keep going to the instance holding its prefix however many short
requests reach that instance between two of its heartbeats.

The defect: the router counted every request it sent an instance as waiting there until the
instance's next heartbeat (0.5 s), even one that had finished or moved on to a decode
instance meanwhile. Five short requests in one heartbeat period made the preferred instance
look 5 deep against an idle one, past the load bound's slack of 4, so the next turn went to
the other instance and found none of its conversation's pages
(``tests/engine/disagg/test_prefix_affinity.py`` failed that way on every run).

Real: the router app on loopback, its event stream and the ``openai`` client. The entry
instances are small FastAPI apps on loopback that answer a submit and stream the request's
event at once: a real engine heartbeats every 0.5 s, and the defect lives exactly between two
heartbeats, so the test must choose when (here: never after registering) they come.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI

from epd_engine.api.protocol import ChatCompletionRequest
from epd_engine.config import Role, internal_token
from epd_engine.contracts.affinity import Affinity
from epd_engine.contracts.routing_policy import InstanceLoad
from tests.engine.router.live import dispatcher, live_router
from tests.processes import free_port

HEADERS = {"X-EPD-Token": internal_token()}
TURNS = 8  # more than the load bound's slack (4) + 1
OPENING = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Tell me about topic number 3."},
]


@asynccontextmanager
async def entry_instance(
    instance_id: str, router_url: str, handed_to: str | None
) -> AsyncIterator[tuple[str, Counter[str]]]:
    """An entry instance that answers each submit with its request's event: the one token
    and the end (``handed_to`` None), or the request taken on by decode instance
    ``handed_to`` (it stays in flight). Yields its URL and its submits per instance id."""
    app = FastAPI()
    seq = itertools.count(1)
    submits: Counter[str] = Counter()

    @app.post("/internal/requests")
    async def submit(body: dict[str, object]) -> dict[str, object]:
        routing = body["routing"]
        assert isinstance(routing, dict)
        submits[instance_id] += 1
        sender = handed_to or instance_id
        event = {
            "seq": next(seq), "router_request_id": routing["router_request_id"],
            "attempt": routing["attempt"], "instance_id": sender, "pool": sender,
            "token_ids": [7], "num_output_tokens": 1, "num_prompt_tokens": 20,
            "text_delta": "x", "finish_reason": None if handed_to else "length",
        }  # fmt: skip
        async with httpx.AsyncClient() as http:
            response = await http.post(
                f"{router_url}/internal/event-stream",
                content=json.dumps(event).encode() + b"\n",
                headers={**HEADERS, "X-EPD-Event-Session": f"{sender}-{instance_id}"},
            )
            response.raise_for_status()
        return {"request_id": routing["router_request_id"], "prompt_tokens": 20, "images": []}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", submits
    finally:
        server.should_exit = True
        await task


@pytest.mark.parametrize("ending", ["finished", "handed_on"])
async def test_turns_between_two_heartbeats_follow_their_prefix(ending: str) -> None:
    handed_to = "d-0" if ending == "handed_on" else None
    async with (
        live_router(instance_timeout_s=60) as (router_url, app),
        entry_instance("ep-0", router_url, handed_to) as (url_0, submits_0),
        entry_instance("ep-1", router_url, handed_to) as (url_1, submits_1),
    ):
        registry = dispatcher(app).registry
        for instance_id, url in (("ep-0", url_0), ("ep-1", url_1)):  # one heartbeat each
            registry.heartbeat(InstanceLoad(instance_id, url, Role.EP, "ep"))
        client = openai.AsyncOpenAI(base_url=f"{router_url}/v1", api_key="-", max_retries=0)
        for _ in range(TURNS):  # one after another, as a conversation's turns come
            if handed_to is None:
                reply = await client.chat.completions.create(
                    model="tiny-llava", messages=OPENING, max_tokens=1,  # type: ignore[arg-type]
                )  # fmt: skip
                assert reply.choices[0].finish_reason == "length"
            else:  # the request stays in flight on its decode instance
                body = ChatCompletionRequest.model_validate(
                    {"model": "tiny-llava", "messages": OPENING}
                )
                request = await dispatcher(app).start(body)
                assert request.holder == handed_to
        counts = dispatcher(app).affinity.counts
        loads = {load.instance_id: load.queue_depth for load in registry.all()}

    assert sorted([*submits_0.values(), *submits_1.values()]) == [TURNS]  # one instance
    assert counts[Affinity.OVERRIDDEN] == 0 and counts[Affinity.FOLLOWED] == TURNS
    assert loads == {"ep-0": 0, "ep-1": 0}  # none of them is counted there any more
