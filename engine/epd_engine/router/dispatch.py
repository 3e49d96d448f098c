"""Sends requests down a path and re-routes them when an instance on it fails."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field

import h11
import numpy as np

from epd_engine.api.completions import CompletionRequest
from epd_engine.api.protocol import ChatCompletionRequest
from epd_engine.config import Stage
from epd_engine.contracts.affinity import LoadBound, PrefixAffinity
from epd_engine.contracts.errors import ClientError, ServiceUnavailable
from epd_engine.contracts.request_owner import new_request_id, new_router_id
from epd_engine.contracts.routing_policy import InstanceLoad, entry_candidates
from epd_engine.contracts.trace import ImageRef, TraceRecord
from epd_engine.metrics import Metrics
from epd_engine.router.affinity_key import image_key, prefix_key
from epd_engine.router.event_relay import EventRelay
from epd_engine.router.inflight import InflightRequest
from epd_engine.router.keepalive_client import Answer, KeepAliveClient
from epd_engine.router.registry import Registry
from epd_engine.router.settings import RouterSettings
from epd_engine.router.trace_recorder import TraceRecorder

log = logging.getLogger(__name__)
SUBMIT_BACKOFF_S = 0.05  # before trying the next instance, doubling per failed one
SUBMIT_TIMEOUT_S = 60.0
DOWN_CHECK_S = 0.25  # how often a pending submit checks its instance is still up


@dataclass
class Dispatcher:
    settings: RouterSettings
    registry: Registry
    http: KeepAliveClient  # submits to instances (on every request's time to first token)
    token: str
    metrics: Metrics
    recorder: TraceRecorder
    affinity: PrefixAffinity = field(init=False)
    inflight: dict[str, InflightRequest] = field(default_factory=dict)
    started_s: float = field(default_factory=time.monotonic)
    # this replica's id: in every request id it makes, so instances send it that request's
    # events (contracts/request_owner.py); heartbeat answers tell instances the id
    router_id: str = field(default_factory=new_router_id)
    events: EventRelay = field(init=False)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.events = EventRelay(self.inflight, self.registry.note_gone)
        s = self.settings
        self.affinity = PrefixAffinity(LoadBound(s.affinity_slack_requests, s.affinity_slack_ratio))

    async def start(self, body: ChatCompletionRequest | CompletionRequest) -> InflightRequest:
        request = InflightRequest(new_request_id(self.router_id), body, time.monotonic())
        self.inflight[request.router_request_id] = request
        try:
            await self._submit(request)
        except Exception:
            self.inflight.pop(request.router_request_id, None)
            self._gone_everywhere(request)
            raise
        return request

    async def _submit(self, request: InflightRequest) -> None:
        """Hand the request to the least-loaded instance of its entry stage. While this runs
        the request is ``submitting``: a failed target is this loop's business, never a
        second re-route's (two copies of one attempt once crashed an engine step)."""
        request.submitting = True
        try:
            await self._submit_once(request)
        finally:
            request.submitting = False

    async def _submit_once(self, request: InflightRequest) -> None:
        has_images = request.body.num_images() > 0
        affinity_on = self.settings.prefix_affinity
        prefix = prefix_key(request.body) if affinity_on else None
        image = image_key(request.body) if affinity_on and has_images else None
        tried: set[str] = set()
        attempt = request.attempt
        while True:
            if request.attempt != attempt or request.finished:
                return  # re-routed or failed meanwhile: that path carries it now
            # the registry now: instances marked down meanwhile are gone, new ones are in
            candidates = entry_candidates(self.registry.active(), has_images)
            options = [c for c in candidates if c.instance_id not in tried]
            if not options:
                stage = "encode" if has_images else "prefill"
                raise ServiceUnavailable(f"no ready instance can run {stage} for this request")
            # an entry that prefills keeps the conversation's KV; an encode-only one, images
            prefills = any(c.role.runs(Stage.PREFILL) for c in options)
            target, affinity = self.affinity.decide(options, prefix if prefills else image)
            self.metrics.affinity.labels(**self.metrics.labels, outcome=affinity.value).inc()
            tried.add(target.instance_id)
            payload = {
                "routing": {
                    "router_request_id": request.router_request_id,
                    "attempt": request.attempt,
                    "path": [],
                    "affinity_key": prefix,
                },
                "body": request.body.model_dump(mode="json", exclude_none=True),
                "resume_output_token_ids": request.token_ids,
                "emitted_text": request.text,
            }
            if request.holder is not None:  # a re-route: it left the instance it was on
                self.registry.note_gone(request.holder, request.router_request_id)
            # counted there from now on: its events can come before this POST's answer
            self.registry.note_assigned(target.instance_id, request.router_request_id)
            request.holder = target.instance_id
            request.instances.append(target.instance_id)
            # The entry pool goes first in the path now: token and migration events from the
            # pools after it can reach the router before this POST's answer does.
            if not request.path or request.path[-1] != target.pool:
                request.path.append(target.pool)
            try:
                request.dispatched_s = time.monotonic()
                response = await self._post_while_up(target, "/internal/requests", payload)
            except (OSError, TimeoutError, h11.ProtocolError) as exc:
                log.warning("submit to %s failed: %r", target.url, exc)
                if isinstance(exc, ConnectionRefusedError):  # nobody listens: down, now
                    self.mark_down(target, "refused connections", keep=request)
                # back off before the next instance: it may be going down the same way
                await asyncio.sleep(min(SUBMIT_BACKOFF_S * 2 ** (len(tried) - 1), 1.0))
                continue
            if 400 <= response.status_code < 500:
                error = response.json().get("error", {})
                raise ClientError(
                    error.get("message", response.text), error.get("param"), error.get("code")
                )
            if response.status_code != 200:
                log.warning("submit to %s answered %d", target.url, response.status_code)
                continue
            request.prompt_info = response.json()
            return

    async def _post_while_up(self, target: InstanceLoad, path: str, payload: object) -> Answer:
        """POST to an instance, given up on as soon as the instance is marked down (a frozen
        instance once held every submit to it for the whole 60 s timeout)."""
        post = asyncio.ensure_future(
            self.http.post_json(
                f"{target.url}{path}",
                payload,
                headers={"X-EPD-Token": self.token},
                timeout_s=SUBMIT_TIMEOUT_S,
            )
        )
        while True:
            done, _ = await asyncio.wait({post}, timeout=DOWN_CHECK_S)
            if done:
                return post.result()
            if self.registry.get(target.instance_id) is None:
                post.cancel()
                raise ConnectionError(f"{target.instance_id} was marked down")

    async def retry(self, router_request_id: str, attempt: int, reason: str) -> None:
        request = self.inflight.get(router_request_id)
        if request is None or request.finished or attempt != request.attempt:
            return
        if request.attempt + 1 >= self.settings.max_attempts:
            request.fail(f"request failed after {request.attempt + 1} attempts: {reason}")
            return
        request.attempt += 1
        log.warning("re-routing %s (attempt %d): %s", router_request_id, request.attempt, reason)
        try:
            await self._submit(request)
        except ClientError as exc:
            request.fail(exc.message)

    async def watch_instances(self, interval_s: float = 0.5) -> None:
        """Drop silent instances and re-route whatever they held."""
        while True:
            await asyncio.sleep(interval_s)
            for dead in self.registry.expire():
                self.mark_down(dead, "stopped answering")

    def mark_down(
        self, instance: InstanceLoad, why: str, keep: InflightRequest | None = None
    ) -> None:
        """Take an instance out of routing (a heartbeat brings it back) and re-route what it
        held; ``keep``: a request the caller is placing itself."""
        log.warning("instance %s (%s) %s: marked down", instance.instance_id, instance.pool, why)
        self.registry.remove(instance.instance_id)
        for request in list(self.inflight.values()):
            if request is keep or request.finished or request.holder != instance.instance_id:
                continue
            if request.submitting:  # its submit loop moves on to another instance itself
                continue
            reason = f"{instance.pool} instance {instance.instance_id} {why}"
            self._spawn(self.retry(request.router_request_id, request.attempt, reason))

    def _spawn(self, work: Coroutine[object, object, None]) -> None:
        task = asyncio.create_task(self._logged(work))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _logged(work: Coroutine[object, object, None]) -> None:
        # a bug in one re-route or abort must not end the loop that started it
        try:
            await work
        except Exception:
            log.exception("router background task failed")

    def abort_everywhere(self, request: InflightRequest) -> None:
        """Tell every instance the request visited to stop it and free its pages (the one
        holding it now may not have said so yet)."""
        for instance_id in dict.fromkeys([*request.instances, request.holder]):
            load = self.registry.get(instance_id or "")
            if load is not None:
                self._spawn(self._abort_at(load, request))

    async def _abort_at(self, load: InstanceLoad, request: InflightRequest) -> None:
        try:
            await self.http.post_json(
                f"{load.url}/internal/requests/{request.router_request_id}/abort",
                {"attempt": request.attempt},
                headers={"X-EPD-Token": self.token},
                timeout_s=5.0,
            )
        except (OSError, TimeoutError, h11.ProtocolError) as exc:
            log.warning("abort of %s at %s failed: %r", request.router_request_id, load.url, exc)

    def _gone_everywhere(self, request: InflightRequest) -> None:
        """The request is over: no instance's load counts it any more."""
        for instance_id in set(request.instances):  # the holder is the last of them
            self.registry.note_gone(instance_id, request.router_request_id)

    def in_flight_records(self, since_s: float) -> list[TraceRecord]:
        """The requests not finished yet that arrived ``since_s`` (router clock) or later, as
        trace records of what is known so far (``TraceRecord.in_flight``)."""
        out = []
        for request in list(self.inflight.values()):
            arrival_s = request.arrival_s - self.started_s
            if arrival_s < since_s or request.finished:
                continue
            info = request.prompt_info
            out.append(
                TraceRecord(
                    arrival_s=arrival_s,
                    prompt_tokens=int(info.get("prompt_tokens", 0)),
                    images=tuple(ImageRef(**i) for i in info.get("images", [])),
                    output_tokens=max(1, len(request.token_ids)),
                    request_id=request.router_request_id,
                    in_flight=True,
                )
            )
        return sorted(out, key=lambda r: r.arrival_s)

    def finish(self, request: InflightRequest, outcome: str) -> None:
        """Record metrics and the trace line of a request that is over."""
        self.inflight.pop(request.router_request_id, None)
        self._gone_everywhere(request)
        if outcome != "success":  # its client left or it failed: nobody should work on it
            self.abort_everywhere(request)
        m = self.metrics
        labels = m.labels
        m.requests.labels(**labels, outcome=outcome).inc()
        e2e_s = time.monotonic() - request.arrival_s
        m.e2e.labels(**labels).observe(e2e_s)
        for stage in ("encode", "prefill", "decode"):
            if stage in request.stage_s:
                m.stage_execution.labels(**labels, stage=stage).observe(request.stage_s[stage])
                queue_s = request.stage_s.get(f"{stage}_queue", 0.0)
                m.stage_queue.labels(**labels, stage=stage).observe(queue_s)
        for kind in ("image", "kv"):
            if f"migration_{kind}" in request.stage_s:
                m.migration.labels(**labels, kind=kind).observe(
                    request.stage_s[f"migration_{kind}"]
                )
        if outcome != "success" or not request.token_times_s:
            return
        ttft_s = request.token_times_s[0] - request.arrival_s
        gaps = np.diff(request.token_times_s).tolist()
        m.observe_tokens(ttft_s, gaps, self.settings.slo, success=True)
        info = request.prompt_info
        record = TraceRecord(
            arrival_s=request.arrival_s - self.started_s,
            prompt_tokens=int(info.get("prompt_tokens", 0)),
            images=tuple(ImageRef(**i) for i in info.get("images", [])),
            output_tokens=len(request.token_ids),
            request_id=request.router_request_id,
            ttft_s=ttft_s,
            tpot_s=tuple(gaps),
            e2e_s=e2e_s,
            path=tuple(request.path),
            stage_s=dict(request.stage_s) or None,
            cached_tokens=request.num_cached_tokens or None,
            # the prompt's prefix identity, from the entry instance (cache/trace_blocks.py):
            # the trace-replay planner models prefix-cache hits on live traffic with it
            hash_ids=tuple(info["hash_ids"]) if info.get("hash_ids") else None,
            hash_block_tokens=info.get("hash_block_tokens") if info.get("hash_ids") else None,
        )
        # the workload's shape, from the same record the trace keeps
        m.request_prompt_tokens.labels(**labels).observe(record.prompt_tokens)
        m.request_images.labels(**labels).observe(len(record.images))
        m.request_output_tokens.labels(**labels).observe(record.output_tokens)
        self.recorder.record(record)
