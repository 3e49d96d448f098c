"""The stage-level scheduler (DESIGN.md §4).

Each iteration: every running decode first; then ongoing chunked prefills and encodes;
then new requests, until the token budget (tau_t) and image budget (tau_e) are used. The
image budget counts image *tokens* (a Qwen2-VL image is a few dozen to thousands of them): an
image is encoded whole, so the first one of an iteration goes even when it alone is larger
than the budget, and one that no longer fits waits for the next iteration (FIFO kept).
When KV pages run out, the newest running request is preempted and later recomputed
(its images are usually still in the encoder-output cache), so nothing crashes or hangs.
An instance runs only the stages of its role; a request whose next stage is elsewhere is
parked as MIGRATING with its pages held until the engine hands it off and releases it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from epd_engine.cache.image_cache import ImageCacheManager
from epd_engine.cache.kv_cache import KVCacheManager, blocks_needed
from epd_engine.cache.window_pages import first_live_page
from epd_engine.config import Role, Stage
from epd_engine.request import CacheKind, Request, RequestStatus
from epd_engine.sampling import TokenLogprobs
from epd_engine.scheduler.output import (
    EncodeTask,
    ImageSlice,
    PullTask,
    SchedulerOutput,
    TokenTask,
)
from epd_engine.scheduler.prefix import match_for_prefill, match_prefix, register_written


@dataclass(frozen=True)
class SchedulerLimits:
    token_budget: int  # tau_t: tokens per iteration (prefill chunks + decodes)
    image_token_budget: int  # tau_e: image tokens encoded per iteration
    max_num_running: int
    max_model_len: int
    # a prefill chunk never ends inside an image (Gemma 3: an image's tokens attend to each
    # other both ways, so all of them are in one step); an image longer than the budget
    # goes whole into a chunk of its own
    whole_images: bool = False
    # the sliding layers' window (Gemma 3), None: every layer global. A KV pull leaves out
    # the pages behind it for those layers; such pages are never published as cached
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for name in ("token_budget", "image_token_budget", "max_num_running", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class RequestEvent:
    """Progress the engine reports upward: a new token and/or the end of the request."""

    request_id: str
    new_token_id: int | None
    finish_reason: str | None = None
    logprobs: TokenLogprobs | None = None  # when the request asked for them
    # prompt tokens this instance's caches served: carried here because a request that
    # ends with this event has left the scheduler by the time its output is made
    num_cached_tokens: int = 0


class Scheduler:
    def __init__(
        self,
        role: Role,
        limits: SchedulerLimits,
        kv: KVCacheManager | None,
        images: ImageCacheManager | None,
    ) -> None:
        if role.needs_language and kv is None:
            raise ValueError(f"role {role} runs prefill/decode and needs a KV cache")
        if role.needs_vision and images is None:
            raise ValueError(f"role {role} runs encode and needs an image cache")
        self.role = role
        self.limits = limits
        self.kv = kv
        self.images = images
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.migrating: dict[str, Request] = {}  # local stages done, pages held for the pull
        self.requests: dict[str, Request] = {}

    # ---- queue management -------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.check_fits(request)
        stale = self.migrating.pop(request.request_id, None)
        if stale is not None:
            # The request came back here (ED+P: encoded here, decodes here) before the
            # release of its parked copy arrived; that copy's pages were pulled already.
            self._release_pages(stale)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def check_fits(self, request: Request) -> None:
        """Reject what could never run here, so it fails at once instead of waiting forever."""
        if request.num_prompt_tokens >= self.limits.max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; the context window is "
                f"{self.limits.max_model_len}"
            )
        if self.kv is not None:
            need = blocks_needed(request.num_prompt_tokens + 1, self.kv.block_size)
            if need > self.kv.pool.num_blocks:
                have = self.kv.pool.num_blocks
                raise ValueError(f"prompt needs {need} KV pages; this instance has {have}")
        if self.images is not None and request.images:
            block_tokens = self.images.block_tokens
            need = sum(blocks_needed(i.num_tokens, block_tokens) for i in request.images)
            if need > self.images.pool.num_blocks:
                raise ValueError(
                    f"{request.num_images} images need {need} image-cache pages; "
                    f"this instance has {self.images.pool.num_blocks}"
                )

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None or request.status.finished:
            return request
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def release_migrated(self, request_id: str) -> bool:
        """The target confirmed its pull: free the pages this instance held for it.

        False when nothing was parked under that id (already released, or the request has
        come back here as a new copy, which must be left alone)."""
        request = self.migrating.pop(request_id, None)
        if request is None:
            return False
        self._release_pages(request)
        self.requests.pop(request_id, None)
        return True

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one iteration ----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        token_budget = self.limits.token_budget
        image_budget = self.limits.image_token_budget
        scheduled: set[str] = set()

        for request in list(self.running):  # 1. every running decode (oldest first)
            if self._schedulable(request) and self._local(request, Stage.DECODE):
                if not self._grow_kv(request, request.num_tokens, out):
                    continue
                out.decodes.append(self._token_task(request, Stage.DECODE, 1))
                token_budget -= 1
                scheduled.add(request.request_id)

        for request in self.running:  # 2. ongoing encodes and chunked prefills
            if request.request_id in scheduled or not self._schedulable(request):
                continue
            image_budget = self._schedule_encodes(request, image_budget, out)
            token_budget = self._schedule_prefill(request, token_budget, out)

        while self.waiting and len(self.running) < self.limits.max_num_running:  # 3. new
            request = self.waiting[0]
            if token_budget <= 0 and (request.next_stage is not Stage.ENCODE or image_budget <= 0):
                break
            if not self._admit(request, out):
                break  # head-of-line: keeps FIFO order fair under memory pressure
            self.waiting.popleft()
            self.running.append(request)
            if request.pulling:
                continue
            image_budget = self._schedule_encodes(request, image_budget, out)
            token_budget = self._schedule_prefill(request, token_budget, out)
        return out

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[RequestEvent]:
        """Apply one executed iteration: advance counters, append tokens, finish, hand off."""
        events: list[RequestEvent] = []
        for encode in out.encodes:
            encoded = self.requests[encode.request_id]
            encoded.num_encoded_images += 1
            assert self.images is not None
            slot = self.images.slots(encode.request_id)[encode.image_index]
            self.images.mark_encoded(encode.content_hash, slot)
        for task in out.token_tasks:
            request = self.requests.get(task.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted while the batch ran
            request.num_computed_tokens += task.num_tokens
            if task.sample:
                events.append(self._append_token(request, sampled[task.request_id]))
        for request in list(self.running):
            self._after_step(request)
        return events

    def pull_done(self, request_id: str) -> None:
        """The migrated-in pages are filled: the request can run its stages here."""
        request = self.requests.get(request_id)
        if request is None or not request.pulling or request.pull is None:
            return
        if request.pull.kind is CacheKind.IMAGE and self.images is not None:
            for image, slot in zip(request.images, self.images.slots(request_id), strict=True):
                if not slot.cached:  # pulled just now: publish for later requests
                    self.images.mark_encoded(image.content_hash, slot)
        if request.pull.kind is CacheKind.KV and self.limits.sliding_window and self.kv:
            # pages behind the window came without their sliding layers: not whole
            partial = first_live_page(
                request.num_computed_tokens, self.limits.sliding_window, self.kv.block_size
            )
            request.num_registered_pages = max(request.num_registered_pages, partial)
        request.pulling = False
        request.pull = None

    def pull_failed(self, request_id: str) -> bool:
        """The source is gone: recompute here if this role can (True), else give it up."""
        request = self.requests.get(request_id)
        if request is None or request.status.finished:
            return False
        kind = request.pull.kind if request.pull else None
        if kind is CacheKind.KV and self.role.runs(Stage.PREFILL):
            self._release_pages(request)
            self.running.remove(request)
            request.pulling, request.pull = False, None
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)
            return True
        self._finish(request, RequestStatus.FINISHED_ERROR)
        return False

    # ---- helpers ----------------------------------------------------------------------
    def _schedulable(self, request: Request) -> bool:
        return request.status is RequestStatus.RUNNING and not request.pulling

    def _local(self, request: Request, stage: Stage) -> bool:
        return request.next_stage is stage and self.role.runs(stage)

    def _admit(self, request: Request, out: SchedulerOutput) -> bool:
        """Take the pages the request's first local stage needs, all or nothing."""
        if request.pull is not None:
            return self._admit_pull(request, out)
        if request.next_stage is Stage.ENCODE and self.role.runs(Stage.ENCODE):
            assert self.images is not None
            slots = self.images.acquire_all(request.request_id, _image_sizes(request))
            if slots is None:
                return False
            request.num_encoded_images = sum(slot.cached for slot in slots)
            if request.num_preemptions == 0:  # a re-admission would find its own images
                request.num_cached_tokens = sum(
                    image.num_tokens
                    for image, slot in zip(request.images, slots, strict=True)
                    if slot.cached
                )
        request.status = RequestStatus.RUNNING
        return True

    def _admit_pull(self, request: Request, out: SchedulerOutput) -> bool:
        """Allocate the target pages of a migration (step 2: the target pulls when it has room)."""
        pull = request.pull
        assert pull is not None
        task = PullTask(request.request_id, pull.kind, pull)
        if pull.kind is CacheKind.IMAGE:
            assert self.images is not None
            slots = self.images.acquire_all(request.request_id, _image_sizes(request))
            if slots is None:
                return False
            for index, slot in enumerate(slots):
                if not slot.cached:
                    task.image_blocks[index] = slot.blocks
        else:
            kv = self.kv
            assert kv is not None
            num_tokens = request.num_computed_tokens
            # pages this instance holds already (a previous turn) are not pulled again
            hit_tokens = match_prefix(kv, request, num_tokens)
            if not kv.grow(request.request_id, num_tokens + 1):
                kv.release(request.request_id)  # a waiting request holds no pages
                request.num_registered_pages = 0
                return False
            kv.count_lookup(num_tokens, hit_tokens)
            kv.count_pull(blocks_needed(num_tokens, kv.block_size), hit_tokens // kv.block_size)
            task = PullTask(
                request.request_id,
                pull.kind,
                pull,
                kv_blocks=list(kv.block_table(request.request_id)),
                num_kv_tokens=num_tokens,
                num_held_kv_pages=hit_tokens // kv.block_size,
            )
        request.status = RequestStatus.RUNNING
        request.pulling = True
        out.pulls.append(task)
        return True

    def _schedule_encodes(self, request: Request, image_budget: int, out: SchedulerOutput) -> int:
        """Queue the request's uncached images while their tokens fit ``image_budget``; returns
        what is left (<= 0: no more encodes this iteration)."""
        if image_budget <= 0 or not self._local(request, Stage.ENCODE):
            return image_budget
        assert self.images is not None
        for index, slot in enumerate(self.images.slots(request.request_id)):
            if image_budget <= 0:
                break
            if slot.cached:
                continue
            image = request.images[index]
            if image.num_tokens > image_budget and out.encodes:
                return 0  # does not fit beside this iteration's others: the next one takes it
            task = EncodeTask(
                request.request_id, index, image.content_hash, image.num_tokens, slot.blocks
            )
            out.encodes.append(task)
            image_budget -= image.num_tokens
        return image_budget

    def _schedule_prefill(self, request: Request, token_budget: int, out: SchedulerOutput) -> int:
        if token_budget <= 0 or not self._local(request, Stage.PREFILL):
            return token_budget
        if any(t.request_id == request.request_id for t in out.encodes):
            return token_budget  # its embeddings are written this iteration; prefill next one
        kv = self.kv
        assert kv is not None
        if (
            request.num_computed_tokens == 0
            and kv.hasher is not None
            and not kv.block_table(request.request_id)
        ):
            match_for_prefill(kv, self.images, request)  # prefill starts after its cached part
        num_tokens = min(request.num_uncomputed_tokens, token_budget)
        if self.limits.whole_images:
            num_tokens = _end_outside_images(request, num_tokens)
        if not kv.grow(request.request_id, request.num_computed_tokens + num_tokens):
            return token_budget  # decodes keep priority on pages; retry next iteration
        out.prefills.append(self._token_task(request, Stage.PREFILL, num_tokens))
        return token_budget - num_tokens

    def _token_task(self, request: Request, stage: Stage, num_tokens: int) -> TokenTask:
        start = request.num_computed_tokens
        stop = start + num_tokens
        assert self.kv is not None
        return TokenTask(
            request_id=request.request_id,
            stage=stage,
            token_ids=request.token_ids_slice(start, stop),
            start_position=start,
            block_table=list(self.kv.block_table(request.request_id)),
            sample=stop == request.num_tokens,
            image_slices=self._image_slices(request, start, stop),
        )

    def _image_slices(self, request: Request, start: int, stop: int) -> list[ImageSlice]:
        if not request.images:  # every decode, and text prompts
            return []
        slices = []
        slots = self.images.slots(request.request_id) if self.images else []
        for image, slot in zip(request.images, slots, strict=False):
            lo = max(start, image.offset)
            hi = min(stop, image.offset + image.num_tokens)
            if lo < hi:
                slices.append(ImageSlice(slot.blocks, lo - image.offset, lo - start, hi - lo))
        return slices

    def _grow_kv(self, request: Request, num_total_tokens: int, out: SchedulerOutput) -> bool:
        """Pages for ``request``, preempting newer requests until they fit.

        False when they do not fit now: either a newer request's pull is still writing into
        its pages (then ``request`` waits a step, it is not preempted), or even alone it
        does not fit (then ``request`` itself was preempted).
        """
        assert self.kv is not None
        while not self.kv.grow(request.request_id, num_total_tokens):
            victim, pull_in_flight = self._newest_running_after(request)
            if victim is not None:
                self._preempt(victim, out)
            elif pull_in_flight:
                return False
            else:
                self._preempt(request, out)
                return False
        return True

    def _newest_running_after(self, anchor: Request) -> tuple[Request | None, bool]:
        """The newest running request admitted after ``anchor`` (lowest priority), if any,
        and whether a newer one is pulling. A pulling request is never the victim: a transfer
        is writing into its pages, and freeing them would hand them to another request."""
        pull_in_flight = False
        for request in reversed(self.running):
            if request is anchor:
                break
            if request.pulling:
                pull_in_flight = True
            elif request.status is RequestStatus.RUNNING:
                return request, pull_in_flight
        return None, pull_in_flight

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Free everything and recompute later; generated tokens are kept."""
        if not self.role.runs(Stage.PREFILL):
            # A decode-only instance cannot recompute: evict; the engine re-routes it
            # through the router (or fails it clearly), never leaves it hanging.
            self._finish(request, RequestStatus.FINISHED_ERROR)
            out.evicted_ids.append(request.request_id)
            return
        self.running.remove(request)
        self._release_kv(request)
        if self.role.runs(Stage.ENCODE):
            if self.images is not None:
                self.images.release(request.request_id)
            request.num_encoded_images = 0
        # else the embeddings were pulled from an encode instance: keep them to recompute
        # from, or the request would look unencoded and migrate back to the encode pool
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted_ids.append(request.request_id)

    def _append_token(self, request: Request, token_id: int) -> RequestEvent:
        request.output_token_ids.append(token_id)
        params = request.sampling
        finish: RequestStatus | None = None
        if not params.ignore_eos and token_id in request.eos_token_ids:
            finish = RequestStatus.FINISHED_STOPPED
        elif (
            len(request.output_token_ids) >= params.max_tokens
            or request.num_tokens >= self.limits.max_model_len
        ):
            finish = RequestStatus.FINISHED_LENGTH
        if finish is not None:
            self._finish(request, finish)
        return RequestEvent(
            request.request_id,
            token_id,
            finish.finish_reason if finish else None,
            num_cached_tokens=request.num_cached_tokens,
        )

    def finish(self, request_id: str, status: RequestStatus) -> None:
        """Finish from outside (a stop string matched after detokenization)."""
        request = self.requests.get(request_id)
        if request is not None and not request.status.finished:
            self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.migrating.pop(request.request_id, None)
        self._release_pages(request)
        request.status = status
        self.requests.pop(request.request_id, None)

    def _after_step(self, request: Request) -> None:
        kv = self.kv  # a page filled up (every block_size tokens): register it
        if (
            kv is not None
            and kv.hasher is not None
            and request.num_computed_tokens // kv.block_size > request.num_registered_pages
        ):
            register_written(kv, request)
        stage = request.next_stage
        if stage is Stage.DECODE and self.images is not None:
            self.images.release(request.request_id)  # prefill consumed the embeddings
        if not self.role.runs(stage) and not request.pulling:
            self.running.remove(request)
            request.status = RequestStatus.MIGRATING
            self.migrating[request.request_id] = request

    def _release_pages(self, request: Request) -> None:
        self._release_kv(request)
        if self.images is not None:
            self.images.release(request.request_id)

    def _release_kv(self, request: Request) -> None:
        """Free the request's KV pages; the written ones stay cached (prefix cache)."""
        kv = self.kv
        if kv is None:
            return
        if kv.hasher is not None:
            register_written(kv, request)
        kv.release(request.request_id)
        request.num_registered_pages = 0


def _image_sizes(request: Request) -> list[tuple[str, int]]:
    return [(image.content_hash, image.num_tokens) for image in request.images]


def _end_outside_images(request: Request, num_tokens: int) -> int:
    """``num_tokens`` cut back to the start of the image it would end inside, or, when that
    image is the chunk's first token, stretched to the image's end."""
    start = request.num_computed_tokens
    stop = start + num_tokens
    for image in request.images:
        end = image.offset + image.num_tokens
        if image.offset < stop < end:
            return image.offset - start if image.offset > start else end - start
    return num_tokens
