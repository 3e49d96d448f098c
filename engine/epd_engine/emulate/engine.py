"""One emulated instance's core: the real scheduler and cache managers, timed by a cost model.

It mirrors ``LLMEngine``'s set-up (pages from the capacity, budgets from the same rule the
engine searches with, ``profiler.budgets``) and its iteration (schedule, run, update), but
"running" a batch is waiting the cost model's time for it and sampling is
``tokens.output_token_id``. It imports no torch: its callers wait with ``asyncio.sleep``.
"""

from __future__ import annotations

from dataclasses import dataclass

from epd_engine.config import SLO, Role
from epd_engine.contracts.plan import Budgets
from epd_engine.emulate.costs import EmulatedCosts
from epd_engine.emulate.tokens import output_token_id
from epd_engine.profiler.budgets import derive_budgets
from epd_engine.profiler.scheduler_parts import scheduler_parts
from epd_engine.request import Request
from epd_engine.scheduler import RequestEvent, Scheduler, SchedulerOutput


class EmulationError(ValueError):
    """The emulated instance cannot start as asked (said to the user as is)."""


@dataclass(frozen=True)
class EmulatedStep:
    """A scheduled batch and how long the cost model says it runs."""

    out: SchedulerOutput
    duration_s: float


class EmulatedEngine:
    def __init__(
        self, role: Role, costs: EmulatedCosts, slo: SLO, budgets: Budgets | None = None
    ) -> None:
        """``budgets``: given (as ``--token-budget`` / ``--image-budget``), else derived from
        the cost model against ``slo`` as the engine's start-up search does."""
        self.role = role
        self.costs = costs
        capacity = costs.model.capacity
        self.capacity = capacity
        derived = budgets or derive_budgets(costs.model, role, slo)
        if derived is None:
            raise EmulationError(
                f"no batch of one meets the SLO (TTFT {slo.ttft_s}s, TPOT {slo.tpot_s}s) for "
                f"role {role.value} under this cost model: a real instance would not start"
            )
        self.budgets = derived
        self.scheduler = Scheduler(role, *scheduler_parts(role, derived, capacity, "emulated"))

    @property
    def tokens_per_image(self) -> int:
        """Tokens each image takes (the cost model's fixed resolution, else one cache page)."""
        return self.capacity.tokens_per_image or self.capacity.image_block_tokens

    def add(self, request: Request) -> None:
        self.scheduler.add(request)  # raises ValueError when it can never fit

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def schedule(self) -> EmulatedStep:
        out = self.scheduler.schedule()
        return EmulatedStep(out, self.costs.step_s(out))

    def finish(self, step: EmulatedStep) -> list[RequestEvent]:
        """The batch has "run": sample each sampling task's token and update the scheduler."""
        requests = self.scheduler.requests
        sampled = {
            task.request_id: output_token_id(
                requests[task.request_id].prompt_token_ids,
                len(requests[task.request_id].output_token_ids),
            )
            for task in step.out.token_tasks
            if task.sample and task.request_id in requests
        }
        return self.scheduler.update(step.out, sampled)
