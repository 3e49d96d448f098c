"""The engine's scheduler as the simulator drives it: the same decisions, no per-token objects.

A simulated decode token used to cost ~11 us of CPU, almost all of it the engine scheduler's
per-request work, written for a model runner: a ``TokenTask`` (and its payload) per decode,
a ``RequestEvent`` per token, several property calls per request per iteration
(``docs/planning.md``, "Where the time goes"). ``SimScheduler`` makes every decision the
engine's ``Scheduler`` makes (it is one: admission, budgets, paging, preemption and
hand-offs are its code), but its iteration hands the simulator the decoding *requests* and
their context (``SimOutput``), and applying an iteration returns the ids that got a token.

``EngineScheduler`` is the reference: the engine's own ``schedule`` / ``update``, payloads
and all, behind the same two methods. ``tests/engine/profiler/test_sim_fast_path.py`` holds
the two to identical simulations on random traces, with and without KV pressure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from epd_engine.config import Stage
from epd_engine.profiler.cost_model import BatchShape
from epd_engine.profiler.steady_decodes import Run, SteadyDecodes
from epd_engine.request import Request, RequestStatus
from epd_engine.scheduler import Scheduler
from epd_engine.scheduler.output import SchedulerOutput, TokenTask
from epd_engine.scheduler.prefix import register_written

_RUNNING = RequestStatus.RUNNING
_ENCODE, _PREFILL, _DECODE = Stage.ENCODE, Stage.PREFILL, Stage.DECODE
_NO_BLOCKS: list[int] = []  # shared, never mutated: the simulator runs no model


# ``Request.next_stage`` called as a function: the hot path asks per request per iteration
# (mypy types a property read on the class as its getter's type, not as a property)
next_stage: Callable[[Request], Stage] = Request.next_stage.fget  # type: ignore[attr-defined]


@dataclass
class SimOutput(SchedulerOutput):
    """One iteration as the simulator needs it: the decodes are the requests themselves
    (``decoding``, in the engine's order) and the context they read, not ``TokenTask``s."""

    decoding: list[Request] = field(default_factory=list)
    decode_context: int = 0  # sum over decodes of the tokens each reads (its position + 1)
    num_steady: int = 0  # decodes of the steady cohort (``steady_decodes.py``), not listed
    steady_context: int = 0  # their share of the context
    # with a cohort: the running requests outside it, in order (the rest of the iteration
    # walks only these); None: every running request
    others: list[Request] | None = None
    engine: SchedulerOutput | None = None  # EngineScheduler only: the engine's own output

    @property
    def is_empty(self) -> bool:
        return not (self.encodes or self.prefills or self.decoding or self.num_steady or self.pulls)

    def shape(self) -> BatchShape:
        """``BatchShape.of`` the engine's output for this iteration."""
        tokens = 0
        pairs = 0.0
        sampled = 0
        for task in self.prefills:
            n = len(task.token_ids)
            tokens += n
            pairs += n * (task.start_position + (n + 1) / 2)  # causal: each query sees its prefix
            sampled += task.sample
        num_decodes = len(self.decoding) + self.num_steady
        return BatchShape(
            num_images=len(self.encodes),
            image_tokens=sum(t.num_tokens for t in self.encodes),
            num_tokens=tokens + num_decodes,
            prefill_kpairs=pairs / 1000.0,
            decode_kcontext=(self.decode_context + self.steady_context) / 1000.0,
            num_sampled=sampled + num_decodes,
        )


@dataclass
class Applied:
    """What one executed iteration produced: ids that got a token, ids that finished; the
    steady cohort's part: whether it ran (a tick to stamp) and the tokens written back."""

    tokens: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    steady: bool = False
    runs: list[Run] = field(default_factory=list)


class SimScheduler(Scheduler):
    """The engine's ``Scheduler`` with ``schedule`` and ``update`` written for the simulator.

    Same order, budgets, paging and preemption as the engine's (those helpers are inherited
    unchanged); what changed is only how the per-request work is done: decodes are collected
    as requests, stages are read without property chains, a page check that needs no new
    page skips the page manager, and applying an iteration (each sampled token is its
    request's scripted answer's, else 0) builds no ``RequestEvent``.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._stages = self.role.stages
        # request id -> the ids it generates (a conversation's answer, ``sim_turns.py``);
        # any other request's tokens are 0
        self.answers: dict[str, list[int]] = {}
        self._zeros: list[int] = []  # token ids never matter: slices of one shared list
        self.steady: SteadyDecodes | None = None  # ``enable_steady``
        self._runs: list[Run] = []  # written back since the last ``apply``

    def enable_steady(self) -> None:
        """Carry plain decodes as one cohort (``steady_decodes.py``; the simulator decides
        when that is exact)."""
        if self.kv is not None and _DECODE in self._stages:
            self.steady = SteadyDecodes(self.kv, self.limits.max_model_len)

    def flush_steady(self) -> list[Run]:
        """Write every steady member back (the end of a run)."""
        if self.steady is not None:
            self.steady.dissolve(self._runs)
        runs, self._runs = self._runs, []
        return runs

    # ---- one iteration ----------------------------------------------------------------
    def schedule(self) -> SimOutput:
        """``Scheduler.schedule``: 1. every running decode, 2. ongoing encodes and chunked
        prefills, 3. new requests, within the token and image budgets."""
        out = SimOutput()
        token_budget = self.limits.token_budget
        image_budget = self.limits.image_token_budget
        active = self._schedule_steady(out)
        if _DECODE in self._stages:
            token_budget -= self._schedule_decodes(out, active) + out.num_steady

        for request in active:  # 2. (a decode is neither: those calls were no-ops)
            if request.status is not _RUNNING or request.pulling:
                continue
            stage = next_stage(request)
            if stage is _ENCODE:
                image_budget = self._schedule_encodes(request, image_budget, out)
            elif stage is _PREFILL:
                token_budget = self._schedule_prefill(request, token_budget, out)

        while self.waiting and len(self.running) < self.limits.max_num_running:  # 3. new
            request = self.waiting[0]
            if token_budget <= 0 and (request.next_stage is not _ENCODE or image_budget <= 0):
                break
            if not self._admit(request, out):
                break  # head-of-line: keeps FIFO order fair under memory pressure
            self.waiting.popleft()
            self.running.append(request)
            if active is not self.running:
                active.append(request)
            if request.pulling:
                continue
            image_budget = self._schedule_encodes(request, image_budget, out)
            token_budget = self._schedule_prefill(request, token_budget, out)
        if active is not self.running:
            out.others = active
        return out

    def _schedule_steady(self, out: SimOutput) -> list[Request]:
        """The steady cohort's decodes and pages for this iteration; returns the running
        requests outside it. When its pages and every other request's next page might not
        all fit, the cohort dissolves first: who gets a page, who is preempted, is then the
        engine's order, request by request."""
        steady = self.steady
        if steady is None or not steady.members:
            return self.running
        kv = self.kv
        assert kv is not None
        due = steady.pages_due()
        others = len(self.running) - len(steady)  # each takes at most one page to decode
        if kv.pool.num_free < len(due) + others:
            steady.dissolve(self._runs)
            return self.running
        if due:
            steady.grow(due)
        out.num_steady = len(steady)
        out.steady_context = steady.context_at()
        members = steady.members
        if len(members) == len(self.running):
            return []  # only the cohort runs (members are running requests)
        return [r for r in self.running if r.request_id not in members]

    def _schedule_decodes(self, out: SimOutput, active: list[Request]) -> int:
        """Step 1 of ``schedule`` for the requests outside the steady cohort; returns the
        number of decodes (one token each)."""
        kv = self.kv
        assert kv is not None
        block_size = kv.block_size
        decoding = out.decoding
        context = 0
        for request in list(active):  # a copy: growing pages may preempt
            if request.status is not _RUNNING or request.pulling:
                continue
            computed = request.num_computed_tokens
            num_prompt = len(request.prompt_token_ids)
            num_tokens = num_prompt + len(request.output_token_ids)
            if (
                request.num_encoded_images < len(request.images)
                or computed < num_prompt
                or num_tokens - computed > 1
            ):
                continue  # not decoding
            has_pages = len(kv.block_table(request.request_id)) * block_size >= num_tokens
            if not has_pages and not self._grow_kv(request, num_tokens, out):
                continue
            decoding.append(request)
            context += computed + 1
        out.decode_context = context
        return len(decoding)

    def apply(self, out: SimOutput) -> Applied:
        """``Scheduler.update`` with each sampled token the request's answer's: advance
        counters, append tokens, finish, park what must migrate."""
        applied = Applied()
        self._apply_encodes(out)
        steady = self.steady
        if out.num_steady:
            assert steady is not None
            for member in steady.finishing():  # its last token: the per-request path's
                last = steady.leave(member, self._runs)
                last.num_computed_tokens += 1
                self._sample(last, applied)
            steady.tick += 1
            applied.steady = True
        requests = self.requests
        max_model_len = self.limits.max_model_len
        tokens = applied.tokens
        scripted = bool(self.answers)
        still_decoding: set[str] = set()  # decoded, not finished: still at decode, and local
        for scheduled in out.decoding:
            request_id = scheduled.request_id
            request = requests.get(request_id)
            if request is None or request.status is not _RUNNING:
                continue  # aborted while the batch ran
            output = request.output_token_ids
            num_prompt = len(request.prompt_token_ids)
            request.num_computed_tokens += 1
            if num_prompt + len(output) != request.num_computed_tokens:
                continue  # the task's ``sample`` was False
            params = request.sampling
            num_output = len(output) + 1
            if (
                params.ignore_eos
                and num_output < params.max_tokens
                and num_prompt + num_output < max_model_len
            ):  # ``_sample``'s common case, inline: a token and no finish
                output.append(self.answer_token(request) if scripted else 0)
                tokens.append(request_id)
                still_decoding.add(request_id)
            else:
                self._sample(request, applied)
        for task in out.prefills:
            request = requests.get(task.request_id)
            if request is None or request.status is not _RUNNING:
                continue
            request.num_computed_tokens += len(task.token_ids)
            if task.sample:
                self._sample(request, applied)
        self._after_step_all(still_decoding, out.others)
        if steady is not None:
            for request in out.decoding:  # decoded here, decodes on: the cohort's now
                if request.request_id in still_decoding:
                    steady.join(request)
        applied.runs, self._runs = self._runs, []
        return applied

    def _after_step_all(self, still_decoding: set[str], others: list[Request] | None) -> None:
        """``Scheduler._after_step`` for every running request, in order. A request that just
        decoded here and goes on is at decode, which this role runs: only the release. A
        steady member is one too, its images released when it joined: only ``others``
        (those still running) are walked."""
        stages = self._stages
        images = self.images
        kv = self.kv
        if kv is not None and kv.hasher is not None:  # a modelled prefix cache (sim_prefix.py)
            block_size = kv.block_size
            for request in self.running:
                if request.num_computed_tokens // block_size > request.num_registered_pages:
                    register_written(kv, request)
        for request in list(self.running) if others is None else others:
            if request.status is not _RUNNING:
                continue  # finished in this iteration (only ``others`` can hold it)
            if request.request_id in still_decoding:
                if images is not None:
                    images.release(request.request_id)
                continue
            stage = next_stage(request)
            if stage is _DECODE and images is not None:
                images.release(request.request_id)  # prefill consumed the embeddings
            if stage not in stages and not request.pulling:
                self.running.remove(request)
                request.status = RequestStatus.MIGRATING
                self.migrating[request.request_id] = request

    def _apply_encodes(self, out: SchedulerOutput) -> None:
        for encode in out.encodes:
            encoded = self.requests[encode.request_id]
            encoded.num_encoded_images += 1
            assert self.images is not None
            slot = self.images.slots(encode.request_id)[encode.image_index]
            self.images.mark_encoded(encode.content_hash, slot)

    def answer_token(self, request: Request) -> int:
        """The token ``request`` generates next: its scripted answer's, else 0."""
        answer = self.answers.get(request.request_id)
        position = len(request.output_token_ids)
        return answer[position] if answer is not None and position < len(answer) else 0

    def _sample(self, request: Request, applied: Applied) -> None:
        """``Scheduler._append_token`` of the answer's token, without its ``RequestEvent``."""
        output = request.output_token_ids
        output.append(self.answer_token(request) if self.answers else 0)
        params = request.sampling
        finish: RequestStatus | None = None
        if not params.ignore_eos and 0 in request.eos_token_ids:
            finish = RequestStatus.FINISHED_STOPPED
        elif (
            len(output) >= params.max_tokens
            or len(request.prompt_token_ids) + len(output) >= self.limits.max_model_len
        ):
            finish = RequestStatus.FINISHED_LENGTH
        applied.tokens.append(request.request_id)
        if finish is not None:
            self._finish(request, finish)
            applied.finished.append(request.request_id)

    # ---- the engine's helpers, with the role's stages computed once ------------------
    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        # ``_schedule_steady`` dissolves the cohort whenever a page might run short
        assert self.steady is None or request.request_id not in self.steady.members
        super()._preempt(request, out)

    def _local(self, request: Request, stage: Stage) -> bool:
        return stage in self._stages and next_stage(request) is stage

    def _token_task(self, request: Request, stage: Stage, num_tokens: int) -> TokenTask:
        # Prefill chunks only (decodes are ``SimOutput.decoding``): no token ids, no pages.
        start = request.num_computed_tokens
        stop = start + num_tokens
        if len(self._zeros) < num_tokens:
            self._zeros = [0] * max(num_tokens, 2 * len(self._zeros))
        return TokenTask(
            request_id=request.request_id,
            stage=stage,
            token_ids=self._zeros[:num_tokens],
            start_position=start,
            block_table=_NO_BLOCKS,
            sample=stop == request.num_tokens,
        )


class EngineScheduler(SimScheduler):
    """The reference: the engine's own ``Scheduler.schedule`` and ``update`` (token-id
    copies, block tables, a ``TokenTask`` per decode, a ``RequestEvent`` per token), behind
    the simulator's ``schedule`` / ``apply``. What the fast path is tested against, and
    ``bench-plan``'s "before"."""

    _local = Scheduler._local
    _token_task = Scheduler._token_task

    def schedule(self) -> SimOutput:
        engine = Scheduler.schedule(self)
        return SimOutput(
            encodes=engine.encodes,
            prefills=engine.prefills,
            decodes=engine.decodes,
            preempted_ids=engine.preempted_ids,
            evicted_ids=engine.evicted_ids,
            pulls=engine.pulls,
            decoding=[self.requests[t.request_id] for t in engine.decodes],
            decode_context=sum(t.start_position + 1 for t in engine.decodes),
            engine=engine,
        )

    def apply(self, out: SimOutput) -> Applied:
        engine = out.engine
        assert engine is not None, "an EngineScheduler applies only its own outputs"
        requests = self.requests
        sampled = {
            t.request_id: self.answer_token(requests[t.request_id])
            for t in engine.token_tasks
            if t.sample
        }
        applied = Applied()
        for event in Scheduler.update(self, engine, sampled):
            applied.tokens.append(event.request_id)
            if event.finish_reason is not None:
                applied.finished.append(event.request_id)
        return applied
