"""Router settings: from ``--config router.json`` (the operator's ConfigMap) and flags."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from epd_engine.config import SLO, Method


class RouterSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1, description="served model name clients send")
    method: Method | None = None  # informational: the plan's method (epd_plan metric)
    slo_ttft_s: float = Field(default=4.0, gt=0)
    slo_tpot_s: float = Field(default=0.08, gt=0)
    slo_attainment: float = Field(default=0.9, gt=0, le=1, description="share to meet both")
    instance_timeout_s: float = Field(default=3.0, gt=0, description="drop after this silence")
    max_attempts: int = Field(default=3, ge=1, description="paths tried per request")
    request_timeout_s: float = Field(default=600.0, gt=0, description="whole request")
    progress_timeout_s: float = Field(
        default=60.0, gt=0, description="fail a request with no event from its holder this long"
    )
    max_request_bytes: int = Field(default=32 * 1024 * 1024, ge=1024, description="body, 413")
    trace_dir: Path | None = None
    trace_max_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    trace_max_files: int = Field(default=4, ge=1)
    active_pools: list[str] | None = None
    # at start, Ready waits this long at most for every pool of active_pools (readiness.py):
    # instances heartbeat every 0.5 s and find a new router address within 2 s
    startup_pool_grace_s: float = Field(default=5.0, ge=0)
    # route by cache affinity (contracts/affinity.py): a conversation's turns to the instance
    # holding its prefix, unless that one holds more than this many requests beyond the least
    # loaded (or this share of the least loaded's, whichever is more)
    prefix_affinity: bool = True
    affinity_slack_requests: int = Field(default=4, ge=0)
    affinity_slack_ratio: float = Field(default=0.5, ge=0)
    plan: dict[str, object] | None = None

    @property
    def slo(self) -> SLO:
        return SLO(ttft_s=self.slo_ttft_s, tpot_s=self.slo_tpot_s, attainment=self.slo_attainment)

    @classmethod
    def from_file(cls, path: Path, **overrides: object) -> RouterSettings:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read router config {path}: {exc}") from exc
        data.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ValueError(f"invalid router config {path}: {exc}") from exc
