"""One ``epdctl serve`` command line, built the same way by every backend.

The Kubernetes pod template, the reconciled local pools and the static launcher each start
instances; they differ in where an instance listens and how it finds its router, never in
the order or the spelling of the flags. The deployment's engine settings come next, then
batch budgets, and the user's extra arguments last, so that they win (argparse keeps the
last value of a repeated flag).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from epd_engine.config import Role
from epd_engine.contracts.plan import Budgets

# what an engine searched at start-up (its /health/ready report) -> the flag that passes it on
SEARCHED_BUDGET_FLAGS = {
    "token_budget": "--token-budget",
    "image_token_budget": "--image-token-budget",
}


@dataclass(frozen=True)
class ServeCommand:
    """Who one instance is, where it listens and what it serves."""

    model: str  # checkpoint directory as the instance sees it
    served_model_name: str
    role: Role
    pool: str
    instance_id: str
    host: str
    port: int
    router: Sequence[str]  # how it reaches its routers, e.g. ("--router-url", "http://...")
    dtype: str
    device: str
    settings: Sequence[str] = ()  # the deployment's engine settings (caches, SLO, transfer)
    budgets: Sequence[str] = ()  # budget flags: the plan's, or those a replica searched
    extra: Sequence[str] = ()  # the user's extra arguments, last so that they win

    def argv(self) -> list[str]:
        return [
            "serve",
            "--model", self.model,
            "--served-model-name", self.served_model_name,
            "--role", self.role.value,
            "--pool", self.pool,
            "--instance-id", self.instance_id,
            "--host", self.host,
            "--port", str(self.port),
            *self.router,
            "--dtype", self.dtype,
            "--device", self.device,
            *self.settings,
            *self.budgets,
            *self.extra,
        ]  # fmt: skip


def plan_budget_flags(budgets: Budgets | None) -> list[str]:
    """A plan's budgets for one role, as flags (none when the plan leaves them to the search)."""
    if budgets is None:
        return []
    return [
        "--image-budget",
        str(budgets.image_budget),
        "--token-budget",
        str(budgets.token_budget),
    ]


def searched_budget_flags(searched: Mapping[str, int]) -> list[str]:
    """Budgets another replica of the same role and settings searched, as flags."""
    flags: list[str] = []
    for name, value in sorted(searched.items()):
        flags += [SEARCHED_BUDGET_FLAGS[name], str(value)]
    return flags


def slo_flags(ttft_s: float, tpot_s: float) -> list[str]:
    return ["--slo-ttft", f"{ttft_s:g}", "--slo-tpot", f"{tpot_s:g}"]
