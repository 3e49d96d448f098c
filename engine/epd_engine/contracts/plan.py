"""The plan contract (DESIGN.md §2): which method, how many instances per pool, batch budgets.

Plans are data shared by the local launcher, the operator and the profiler. No torch here.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from epd_engine.config import Method, Role


class Budgets(BaseModel):
    """Per-iteration batch budgets of one pool: tau_e in images of one image-cache page each
    (the engine's ``--image-budget``: it encodes up to ``image_budget`` x page tokens per
    iteration; LLaVA-1.5 576 a page), tau_t in tokens."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    image_budget: int = Field(ge=1)
    token_budget: int = Field(ge=1)


class Prediction(BaseModel):
    """What the profiler predicts this plan achieves on the trace it was searched on."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    goodput_rps: float = Field(ge=0)
    ttft_p90_s: float = Field(ge=0)
    tpot_p90_s: float = Field(ge=0)


class TraceRef(BaseModel):
    """Which trace a plan was derived from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    requests: int = Field(ge=0)
    window: str = ""
    digest: str = ""


class Plan(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Method
    pools: dict[Role, int]
    budgets: dict[Role, Budgets] = Field(default_factory=dict)
    predicted: Prediction | None = None
    reason: str = ""
    trace: TraceRef | None = None

    @model_validator(mode="after")
    def _pools_match_method(self) -> Plan:
        expected = set(self.method.roles)
        if set(self.pools) != expected:
            roles = ", ".join(sorted(r.value for r in expected))
            got = ", ".join(sorted(r.value for r in self.pools)) or "none"
            raise ValueError(f"method {self.method.value} needs pools {roles}; got {got}")
        for role, count in self.pools.items():
            if count < 1:
                raise ValueError(f"pool {role.value} needs at least 1 instance, got {count}")
        unknown = set(self.budgets) - expected
        if unknown:
            raise ValueError(
                f"budgets for roles not in the method: {sorted(r.value for r in unknown)}"
            )
        return self

    @property
    def num_instances(self) -> int:
        return sum(self.pools.values())

    def describe(self) -> str:
        """Compact human form, e.g. ``E+P+D 1E3P4D``."""
        ratio = "".join(f"{self.pools[r]}{r.value}" for r in self.method.roles)
        return f"{self.method.value} {ratio}"
