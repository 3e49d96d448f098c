"""One simulated engine instance: the real scheduler (``SimScheduler``) with real cache
managers, no model.

Also turns trace records into the engine's ``Request`` objects the scheduler consumes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from epd_engine.config import Role
from epd_engine.contracts.plan import Budgets
from epd_engine.contracts.routing_policy import InstanceLoad
from epd_engine.contracts.trace import TraceRecord
from epd_engine.profiler.cost_model import Capacity, FittedCostModel
from epd_engine.profiler.scheduler_parts import scheduler_parts
from epd_engine.profiler.sim_prefix import (
    HASH_BLOCK_TOKENS,
    SIM_PREFIX_SALT,
    image_offsets,
    prompt_token_ids,
)
from epd_engine.profiler.sim_scheduler import SimOutput, SimScheduler
from epd_engine.profiler.sim_turns import Laid, TurnScript
from epd_engine.request import ImageRef, Request
from epd_engine.sampling import SamplingParams


def build_scheduler(
    role: Role,
    budgets: Budgets,
    capacity: Capacity,
    kind: type[SimScheduler] = SimScheduler,
    prefix_cache: bool = False,
) -> SimScheduler:
    """A simulated instance's scheduler (``kind``: ``EngineScheduler`` for the reference
    path; ``prefix_cache``: its KV pages cached by key, ``sim_prefix.py``)."""
    salt = SIM_PREFIX_SALT if prefix_cache else None
    return kind(role, *scheduler_parts(role, budgets, capacity, salt))


@dataclass
class SimInstance:
    index: int
    role: Role
    scheduler: SimScheduler
    step: SimOutput | None = None  # the iteration in flight (the instance is busy)
    num_incoming: int = 0  # migrations on their way here: queued in the real protocol's step 1
    node: str = ""  # where it runs (placement.py): migrations to another node pay its link
    handed_off: set[str] = field(default_factory=set)  # migrating requests already dispatched
    busy_s: float = 0.0
    step_end: float = 0.0  # when the iteration in flight ends
    last_step_end: float = 0.0  # when the iteration before it ended
    steady_stamps: list[float] = field(default_factory=list)  # end of each steady tick
    # Shared host: when the front (preprocessing) running in this process ends; iterations
    # started before then share the process with it and push it back (``simulator``).
    front_until: float = 0.0
    front_index: int = -1  # the request whose front that is
    # routing indexes (``sim_routing.IndexedPool``) to tell of a change: (set, position)
    watchers: list[tuple[set[int], int]] = field(default_factory=list)
    _load: InstanceLoad | None = None

    @property
    def instance_id(self) -> str:
        return f"{self.role.value}-{self.index}"

    def changed(self) -> None:
        """Its queues or pages changed: the next ``load()`` recomputes (cheap routing)."""
        self._load = None
        for changed, position in self.watchers:
            changed.add(position)

    def load(self) -> InstanceLoad:
        """What this instance's heartbeat would report to the router (exact, not stale)."""
        if self._load is None:
            self._load = self._measure_load()
        return self._load

    def order(self) -> tuple[int, int, str]:
        """``load_order(self.load())``, without building the load: the routing index asks
        after every change (``sim_routing.IndexedPool``), far more often than it picks."""
        sched = self.scheduler
        free = sched.kv.pool.num_free if sched.kv else 0
        if sched.images:
            free += sched.images.pool.num_free
        depth = len(sched.waiting) + self.num_incoming + len(sched.running)
        return (depth, -free, self.instance_id)

    def _measure_load(self) -> InstanceLoad:
        sched = self.scheduler
        return InstanceLoad(
            instance_id=self.instance_id,
            url="",
            role=self.role,
            pool=self.role.value,
            num_waiting=len(sched.waiting) + self.num_incoming,
            num_running=len(sched.running),
            free_kv_blocks=sched.kv.pool.num_free if sched.kv else 0,
            free_image_blocks=sched.images.pool.num_free if sched.images else 0,
            node=self.node,
        )


class RequestFactory:
    """Trace records -> engine requests (ids are the record's index in ``records``).

    ``prefix_cache``: the instances model the prefix cache, so a prompt's token ids carry
    its shared blocks (``sim_prefix.py``), a conversation's turns are written so the next
    finds the answer's pages (``sim_turns.py``; ``answers``: the ids each request
    generates) and no recorded hit is replayed."""

    def __init__(
        self,
        cost: FittedCostModel,
        prefix_cache: bool = False,
        block_tokens: int = HASH_BLOCK_TOKENS,
        records: Sequence[TraceRecord] = (),
    ) -> None:
        self.cost = cost
        self.prefix_cache = prefix_cache
        self.block_tokens = block_tokens
        self.records = records
        self.turns = TurnScript(records, self._layout) if prefix_cache else None
        self.answers: dict[str, list[int]] = {}
        # token ids matter only to a prefix cache: otherwise share one prompt per length
        self._prompts: dict[int, list[int]] = {}

    def image_tokens(self, record: TraceRecord) -> list[int]:
        return [self.cost.image_tokens(image.tokens) for image in record.images]

    def _images(self, record: TraceRecord) -> list[ImageRef]:
        sizes = self.image_tokens(record)
        return [
            ImageRef(image.hash, offset, num_tokens, image.width, image.height)
            for image, num_tokens, offset in zip(
                record.images, sizes, image_offsets(record, sizes), strict=True
            )
        ]

    def _layout(self, index: int) -> Laid:
        record = self.records[index]
        images = self._images(record)
        image_tokens = sum(image.num_tokens for image in images)
        total = image_tokens + record.prompt_tokens
        ids, own_from = prompt_token_ids(record, index, image_tokens, total, self.block_tokens)
        return Laid(ids, images, own_from)

    def make(self, index: int, record: TraceRecord) -> Request:
        images = self._images(record)
        total = sum(image.num_tokens for image in images) + record.prompt_tokens
        if self.turns is not None:
            prompt, answer = self.turns.prompt_and_answer(index)
            if answer:
                self.answers[str(index)] = answer
        else:
            prompt = self._prompts.setdefault(total, [0] * total)
        sampling = SamplingParams(max_tokens=record.output_tokens, temperature=0.0, ignore_eos=True)
        request = Request(
            request_id=str(index),
            prompt_token_ids=prompt,
            sampling=sampling,
            images=images,
            arrival_s=record.arrival_s,
        )
        if not self.prefix_cache:
            # what the caches served as the trace recorded it: prefill starts after it, as
            # the engine's does after its prefix cache's pages (at least one token computed)
            request.num_computed_tokens = max(0, min(record.cached_tokens or 0, total - 1))
        return request
