"""One client request as the router sees it: ordered tokens from whichever instance, the
instance holding it now, the pools it visited, and its latency record."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from epd_engine.api.completions import CompletionRequest
from epd_engine.api.protocol import ChatCompletionRequest
from epd_engine.timing import clock_domain

# Hops between instances, by the stage that ended on the source (``InflightRequest.marks``).
_HOP_AFTER = {"encode": "hop_image", "prefill": "hop_kv"}


@dataclass
class ClientChunk:
    text: str
    num_tokens: int
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[dict[str, Any]] | None = None  # OpenAI logprobs content, one per token


@dataclass
class InflightRequest:
    router_request_id: str
    body: ChatCompletionRequest | CompletionRequest
    arrival_s: float  # monotonic
    attempt: int = 0
    holder: str | None = None  # instance id that has it now
    submitting: bool = False  # the dispatcher is handing it to an entry instance now
    path: list[str] = field(default_factory=list)
    instances: list[str] = field(default_factory=list)  # instance ids visited, in order
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    token_times_s: list[float] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens an instance's cache served (the most reported)
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # when the client asked
    prompt_info: dict[str, Any] = field(default_factory=dict)
    stage_s: dict[str, float] = field(default_factory=dict)
    finish_reason: str | None = None
    error: str | None = None
    chunks: asyncio.Queue[ClientChunk] = field(default_factory=asyncio.Queue)
    _pending: list[dict[str, Any]] = field(default_factory=list)  # not yet in order
    # (instance id, stage) -> [ready_at, end_at], monotonic, from instances in our clock domain
    marks: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    dispatched_s: float | None = None  # monotonic: the router POSTed it to its entry instance

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, event: dict[str, Any]) -> None:
        """Apply one instance event; token events are applied strictly in token order."""
        if event.get("attempt", 0) != self.attempt or self.finished:
            return  # a stale path after a retry, or late news
        self._note_location(event)
        self.num_cached_tokens = max(self.num_cached_tokens, event.get("num_cached_tokens") or 0)
        timings = event.get("stage_timings") or []
        for timing in timings:
            stage = timing["stage"]
            self.stage_s[f"{stage}_queue"] = (
                self.stage_s.get(f"{stage}_queue", 0) + timing["queue_s"]
            )
            self.stage_s[stage] = self.stage_s.get(stage, 0) + timing["exec_s"]
            self._mark(event.get("instance_id"), timing)
        had_first = bool(self.token_times_s)
        self._apply_tokens(event)
        if timings or (self.token_times_s and not had_first):
            self._derive_hops()

    def _mark(self, instance_id: str | None, timing: dict[str, Any]) -> None:
        """Keep a stage's monotonic marks when its instance shares our clock (one host)."""
        ready, end = timing.get("ready_at"), timing.get("end_at")
        clock = clock_domain()
        if not clock or timing.get("clock") != clock:
            return
        if instance_id is None or ready is None or end is None:
            return
        mark = self.marks.setdefault((instance_id, timing["stage"]), [ready, end])
        mark[0], mark[1] = min(mark[0], ready), max(mark[1], end)

    def _derive_hops(self) -> None:
        """Seconds between the stages of different processes, from their monotonic marks
        (only marks of instances on the router's host are kept, ``_mark``): ``front``, the
        router's arrival to the first instance's first stage ready (router, HTTP and that
        instance's preprocessing); ``hop_image`` / ``hop_kv``, an instance's last stage end
        (encode / prefill) to the next instance's first stage ready (the hand-off's offer;
        the pull is in the target's stage queue; an early KV offer can be negative);
        ``tail``, the end of the stage that sampled the first token to its arrival here;
        ``front_router``, the part of ``front`` before the router sent the request on (the
        rest is the entry instance's: HTTP, preprocessing, tokenizing)."""
        if len(set(self.instances)) != len(self.instances):  # back to an instance: ambiguous
            for key in ("front", "front_router", "tail", *_HOP_AFTER.values()):
                self.stage_s.pop(key, None)
            return
        spans = []  # (first ready, last end, last stage) per instance, in visit order
        for instance in self.instances:
            own = [(stage, m) for (i, stage), m in self.marks.items() if i == instance]
            if not own:
                return  # not every instance reported (yet)
            last = max(own, key=lambda sm: sm[1][1])
            spans.append((min(m[0] for _, m in own), last[1][1], last[0]))
        self.stage_s["front"] = spans[0][0] - self.arrival_s
        if self.dispatched_s is not None:
            self.stage_s["front_router"] = self.dispatched_s - self.arrival_s
        for (_, end, stage), (ready, _, _) in itertools.pairwise(spans):
            if hop := _HOP_AFTER.get(stage):
                self.stage_s[hop] = ready - end
        prefill_ends = [m[1] for (_, stage), m in self.marks.items() if stage == "prefill"]
        if self.token_times_s and prefill_ends:
            self.stage_s["tail"] = self.token_times_s[0] - min(prefill_ends)

    def _apply_tokens(self, event: dict[str, Any]) -> None:
        if migration := event.get("migration"):
            key = f"migration_{migration['kind']}"
            self.stage_s[key] = self.stage_s.get(key, 0) + migration["seconds"]
        has_news = event.get("token_ids") or event.get("finish_reason") or event.get("error")
        if event.get("num_output_tokens") is None or not has_news:
            return
        self.num_prompt_tokens = event.get("num_prompt_tokens") or self.num_prompt_tokens
        self._pending.append(event)
        self._drain()

    def _note_location(self, event: dict[str, Any]) -> None:
        self.holder = event.get("instance_id", self.holder)
        if self.holder and (not self.instances or self.instances[-1] != self.holder):
            self.instances.append(self.holder)
        pool = event.get("pool")
        if pool and pool not in self.path:  # late events from an earlier pool add nothing
            self.path.append(pool)

    def _drain(self) -> None:
        """Apply pending events whose place is next: ``num_output_tokens`` counts tokens
        including the event's own, so an event fits when it equals ours plus its tokens."""
        progress = True
        while progress and self._pending and not self.finished:
            progress = False
            for event in list(self._pending):
                expected = len(self.token_ids) + len(event["token_ids"])
                if event["num_output_tokens"] > expected:
                    continue  # an earlier event is still on its way
                self._pending.remove(event)
                progress = True
                if event["num_output_tokens"] == expected:
                    self._apply_in_order(event)
                    break

    def _apply_in_order(self, event: dict[str, Any]) -> None:
        new_ids = event["token_ids"]
        self.token_ids += new_ids
        self.token_times_s += [time.monotonic()] * len(new_ids)
        self.text += event.get("text_delta") or ""
        if event.get("error"):
            self.fail(str(event["error"]))
            return
        finish = event.get("finish_reason")
        logprobs = event.get("logprobs")
        self.logprobs += logprobs or []
        text = event.get("text_delta") or ""
        self.chunks.put_nowait(ClientChunk(text, len(new_ids), finish, logprobs=logprobs))
        if finish is not None:
            self.finish_reason = finish
            self._pending.clear()

    def fail(self, message: str) -> None:
        if self.finished:
            return
        self.finish_reason = "error"
        self.error = message
        self.chunks.put_nowait(ClientChunk("", 0, "error", message))
