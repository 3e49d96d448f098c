"""The trace's path starts with the entry pool even when a later pool's events reach the
router before the entry instance's answer to the submit (seen under load: E+P+D requests
recorded as visiting ``d`` or ``p`` first).

Real: the router app on loopback and its event stream. The entry instance is a small
FastAPI app on loopback that, before answering the submit, streams an event from pool
``p`` to the router: the ordering the race produces, made certain.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import uvicorn
from fastapi import FastAPI

from epd_engine.api.protocol import ChatCompletionRequest
from epd_engine.config import Role, internal_token
from epd_engine.contracts.routing_policy import InstanceLoad
from tests.engine.router.live import dispatcher, live_router
from tests.processes import free_port


async def test_entry_pool_leads_the_path_when_later_events_arrive_first() -> None:
    headers = {"X-EPD-Token": internal_token()}
    async with live_router() as (router_url, app), httpx.AsyncClient() as http:
        entry = FastAPI()

        @entry.post("/internal/requests")
        async def submit(body: dict[str, object]) -> dict[str, object]:
            routing = body["routing"]
            assert isinstance(routing, dict)
            event = {"seq": 1, "router_request_id": routing["router_request_id"],
                     "attempt": 0, "instance_id": "p-0", "pool": "p"}  # fmt: skip
            response = await http.post(
                f"{router_url}/internal/event-stream",
                content=json.dumps(event).encode() + b"\n",
                headers={**headers, "X-EPD-Event-Session": "p-0"},
            )
            response.raise_for_status()
            return {"request_id": "x", "prompt_tokens": 3, "images": []}

        port = free_port()
        server = uvicorn.Server(
            uvicorn.Config(entry, host="127.0.0.1", port=port, log_level="warning")
        )
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            load = InstanceLoad("e-0", f"http://127.0.0.1:{port}", Role.EP, "e")
            dispatcher(app).registry.heartbeat(load)
            body = ChatCompletionRequest(
                model="tiny-llava", messages=[{"role": "user", "content": "hi"}]
            )
            request = await dispatcher(app).start(body)
        finally:
            server.should_exit = True
            await task

    assert request.path == ["e", "p"]
