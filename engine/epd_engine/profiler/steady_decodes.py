"""Steady decodes: requests that only decode, advanced together in O(1) per iteration.

A simulated decode token cost ~15 us of CPU even on ``SimScheduler``'s fast path: every
iteration walked every decoding request (its counters, its pages, its token, its gap). At
fleet scale (256 instances, 10,000 requests, ~1.5 M tokens) that walk was ~95 % of a plan
search. Yet between events a decoding request's iteration is always the same: one token,
its context one longer, a new page every ``block_size`` tokens, done at its length. So a
request that decoded here and goes on decoding joins the instance's *steady* cohort, and
an iteration charges the whole cohort in O(1): its size and context sum (``context_at``),
the pages that fall due (a heap by iteration) and the requests that finish (another). A
member's counters, tokens and token times are written back only when it leaves: when it
finishes, or when the cohort dissolves because pages could run short (then the engine's
own order of page growth and preemption decides, request by request, as before).

Ticks count the iterations the cohort ran in; the simulator stamps each with its end time
(``Applied.steady``), so a member's tokens are the stamps from its join to its leave and
its gaps are their differences, to the last float what the per-request path records.
``tests/engine/profiler/test_sim_fast_path.py`` holds the two to identical simulations.

Only for plain requests: no scripted answers and no prefix cache (their pages and token
ids matter per token), and a client that sees every token (no silent tokens: a gap is then
one iteration); ``Simulator`` turns it on only then.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from epd_engine.cache.kv_cache import KVCacheManager
from epd_engine.request import Request


@dataclass(eq=False)
class Member:
    request: Request
    join: int  # the tick of its first steady token
    computed: int  # its counters at the join
    num_output: int
    pages_until: int  # its first tick needing a page, then each block_size ticks on
    done_at: int  # the tick of its last token (taken by the per-request path)
    left: bool = False

    def context_offset(self) -> int:
        """Its context at tick t is ``computed + 1 + (t - join)``: this, plus t."""
        return self.computed + 1 - self.join


@dataclass
class Run:
    """Tokens a member got while steady: the ticks ``first`` .. ``first + count - 1``."""

    request_id: str
    first: int
    count: int


@dataclass
class SteadyDecodes:
    kv: KVCacheManager
    max_model_len: int
    members: dict[str, Member] = field(default_factory=dict)
    tick: int = 0  # iterations the cohort has run in, ever (the simulator's stamps)
    _context_base: int = 0  # sum of the members' ``context_offset``
    # Members by the phase of their page growth: a member fills a page every block_size
    # ticks, so it needs one at every tick of its phase (tick % block_size) once its first
    # is due (``pages_until``, at most one period after its join).
    _by_phase: list[dict[str, Member]] = field(default_factory=list)
    _finishing: list[tuple[int, int, Member]] = field(default_factory=list)
    _seq: int = 0
    _zeros: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._by_phase = [{} for _ in range(self.kv.block_size)]

    def __len__(self) -> int:
        return len(self.members)

    def context_at(self) -> int:
        """The cohort's share of this iteration's ``decode_context``."""
        return self._context_base + len(self.members) * self.tick

    def join(self, request: Request) -> None:
        """``request`` got its token this iteration and decodes on: from the next tick on,
        the cohort carries it."""
        block = self.kv.block_size
        num_prompt = len(request.prompt_token_ids)
        num_output = len(request.output_token_ids)
        num_tokens = num_prompt + num_output
        pages = len(self.kv.block_table(request.request_id))
        length = min(request.sampling.max_tokens, self.max_model_len - num_prompt)
        member = Member(
            request,
            join=self.tick,
            computed=request.num_computed_tokens,
            num_output=num_output,
            # at tick t it reads num_tokens + (t - join) tokens; pages hold pages * block
            pages_until=self.tick + pages * block - num_tokens + 1,
            # at tick t its output reaches num_output + (t - join) + 1 tokens
            done_at=self.tick + length - 1 - num_output,
        )
        self.members[request.request_id] = member
        self._context_base += member.context_offset()
        self._by_phase[member.pages_until % block][request.request_id] = member
        self._push(self._finishing, member.done_at, member)

    def pages_due(self) -> list[Member]:
        """The members that need a page at this tick."""
        tick = self.tick
        phase = self._by_phase[tick % len(self._by_phase)]
        return [member for member in phase.values() if member.pages_until <= tick]

    def grow(self, due: list[Member]) -> None:
        """A page each for this tick (the caller checked that they are free)."""
        grown = self.kv.add_pages([member.request.request_id for member in due])
        assert grown, "a steady member's page was checked free"
        for member in due:
            member.pages_until = self.tick  # its first is past: one every period from now

    def finishing(self) -> list[Member]:
        """The members whose last token is this tick's (popped)."""
        heap = self._finishing
        if not heap or heap[0][0] > self.tick:
            return []
        done = []
        while heap and heap[0][0] <= self.tick:
            _, _, member = heapq.heappop(heap)
            if not member.left:
                done.append(member)
        return done

    def leave(self, member: Member, runs: list[Run]) -> Request:
        """Write back the tokens it got while steady (ticks before this one); it is a plain
        running request again."""
        member.left = True
        request_id = member.request.request_id
        del self.members[request_id]
        self._by_phase[member.pages_until % len(self._by_phase)].pop(request_id)
        self._context_base -= member.context_offset()
        count = self.tick - member.join
        if count:
            request = member.request
            request.num_computed_tokens += count
            if len(self._zeros) < count:
                self._zeros = [0] * max(count, 2 * len(self._zeros))
            request.output_token_ids.extend(self._zeros[:count])  # unscripted tokens are 0
            runs.append(Run(request.request_id, member.join, count))
        return member.request

    def dissolve(self, runs: list[Run]) -> None:
        """Every member leaves (pages may run short: the per-request path decides)."""
        for member in list(self.members.values()):
            self.leave(member, runs)
        self._finishing.clear()

    def _push(self, heap: list[tuple[int, int, Member]], tick: int, member: Member) -> None:
        self._seq += 1
        heapq.heappush(heap, (tick, self._seq, member))
