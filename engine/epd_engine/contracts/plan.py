"""The plan contract (DESIGN.md §2): which method, how many instances per pool, batch budgets.

Plans are data shared by the local launcher, the operator and the profiler. No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

from epd_engine.config import TENSOR_PARALLEL_SIZES, Method, Role


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
    # ranks each instance of a pool splits its language model over, where above 1 (issue
    # 34): its pods then take that many GPUs per instance
    tensor_parallel: dict[Role, int] = Field(default_factory=dict)
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
        for role, size in self.tensor_parallel.items():
            if role not in expected:
                raise ValueError(f"a tensor-parallel size for {role.value}, not in the method")
            if size not in TENSOR_PARALLEL_SIZES:
                sizes = ", ".join(map(str, TENSOR_PARALLEL_SIZES))
                raise ValueError(f"{role.value}'s tensor-parallel size must be one of {sizes}")
            if size > 1 and not role.needs_language:
                raise ValueError(f"{role.value} runs no language model to split over ranks")
        return self

    def size_of(self, role: Role) -> int:
        """Ranks per instance of ``role``'s pool."""
        return self.tensor_parallel.get(role, 1)

    @property
    def num_ranks(self) -> int:
        """Ranks over every instance, each one device's worth: what a GPU budget counts
        (the instances where none splits its language model)."""
        return sum(n * self.size_of(r) for r, n in self.pools.items())

    @property
    def num_instances(self) -> int:
        return sum(self.pools.values())

    def describe(self) -> str:
        """Compact human form (``describe_pools``)."""
        return describe_pools(self.method, self.pools, self.tensor_parallel)


def describe_pools(method: Method, pools: Mapping[Role, int], sizes: Mapping[Role, int]) -> str:
    """E.g. ``E+P+D 1E3P4D``; with tensor-parallel pools (``sizes``, where above 1) each pool
    apart and its size after an x: ``E+P+D 1E 1Px2 2D`` (P's instances at two ranks)."""
    parts = [
        f"{pools[r]}{r.value}" + (f"x{sizes[r]}" if sizes.get(r, 1) > 1 else "")
        for r in method.roles
    ]
    return f"{method.value} {(' ' if sizes else '').join(parts)}"
