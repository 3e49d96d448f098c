"""An instance's link to its router: register + heartbeat load, ordered event delivery.

The heartbeat answer carries the router's table of active instances; migration sources
pick their targets from it by load. Events go over one stream (``event_stream.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import httpx

from epd_engine.api.auth import TOKEN_HEADER, internal_headers
from epd_engine.api.logprobs import logprob_content
from epd_engine.contracts.routing_policy import InstanceLoad
from epd_engine.disagg.event_stream import EventStream
from epd_engine.engine.async_engine import RequestOutput
from epd_engine.engine.llm_engine import LLMEngine, StageTiming, startup
from epd_engine.timing import clock_domain
from epd_engine.transfer.messages import Routing

log = logging.getLogger(__name__)


class RouterLink:
    def __init__(
        self,
        router_url: str,
        identity: InstanceLoad,
        http: httpx.AsyncClient,
        token: str,
        heartbeat_s: float = 0.5,
        token_text: Callable[[int], str] | None = None,
    ) -> None:
        self.router_url = router_url.rstrip("/")
        self.identity = identity
        self.http = http
        self.headers = {**internal_headers(), TOKEN_HEADER: token}
        self.heartbeat_s = heartbeat_s
        # one token's text: logprobs go to the router rendered (it has no tokenizer)
        self.token_text = token_text
        self.instances: list[InstanceLoad] = []
        self.events = EventStream(f"{self.router_url}/internal/event-stream", self.headers)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, engine: LLMEngine) -> None:
        self._tasks = [
            asyncio.create_task(self._heartbeats(engine)),
            asyncio.create_task(self.events.run()),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def load(self, engine: LLMEngine) -> InstanceLoad:
        s = engine.scheduler
        return InstanceLoad(
            instance_id=self.identity.instance_id,
            url=self.identity.url,
            role=self.identity.role,
            pool=self.identity.pool,
            num_waiting=len(s.waiting),
            num_running=len(s.running),
            free_kv_blocks=s.kv.pool.num_free if s.kv else 0,
            free_image_blocks=s.images.pool.num_free if s.images else 0,
        )

    async def _heartbeats(self, engine: LLMEngine) -> None:
        while True:
            try:
                response = await self.http.post(
                    f"{self.router_url}/internal/instances/heartbeat",
                    json=self.load(engine).to_json(),
                    headers=self.headers,
                    timeout=5.0,
                )
                response.raise_for_status()
                self.instances = [InstanceLoad.from_json(d) for d in response.json()["instances"]]
                startup.mark("registered")
            except (httpx.HTTPError, KeyError, ValueError) as exc:
                log.warning("heartbeat to %s failed: %r", self.router_url, exc)
            await asyncio.sleep(self.heartbeat_s)

    def send(self, output: RequestOutput, routing: Routing) -> None:
        """Queue one output for the router (loop thread); a single stream keeps the order."""
        event: dict[str, Any] = {
            "router_request_id": routing.router_request_id,
            "attempt": routing.attempt,
            "instance_id": self.identity.instance_id,
            "pool": self.identity.pool,
            "token_ids": output.new_token_ids,
            "text_delta": output.text_delta,
            "num_prompt_tokens": output.num_prompt_tokens,
            "num_output_tokens": output.num_output_tokens,
            "num_cached_tokens": output.num_cached_tokens,
            "finish_reason": output.finish_reason,
            "error": output.error,
            "stage_timings": [_timing_json(t) for t in output.stage_timings],
        }
        if output.logprobs and self.token_text is not None:
            content = logprob_content(output.new_token_ids, output.logprobs, self.token_text)
            event["logprobs"] = [entry.model_dump() for entry in content]
        self.events.put(event)

    def send_raw(self, event: dict[str, object]) -> None:
        self.events.put(event)

    async def retry(self, routing: Routing, reason: str) -> None:
        """Ask the router to send the request down a fresh path (this instance cannot go on)."""
        try:
            await self.http.post(
                f"{self.router_url}/internal/requests/{routing.router_request_id}/retry",
                json={"attempt": routing.attempt, "reason": reason},
                headers=self.headers,
                timeout=10.0,
            )
        except httpx.HTTPError as exc:
            log.error("cannot ask the router to retry %s: %r", routing.router_request_id, exc)


def _timing_json(timing: StageTiming) -> dict[str, Any]:
    """One stage's timing for the router; with its monotonic marks and this host's clock
    domain when known (the router compares marks only within its own domain)."""
    data: dict[str, Any] = {
        "stage": timing.stage.value,
        "queue_s": timing.queue_s,
        "exec_s": timing.exec_s,
    }
    if timing.ready_at is not None and timing.end_at is not None and (clock := clock_domain()):
        data.update(ready_at=timing.ready_at, end_at=timing.end_at, clock=clock)
    return data
