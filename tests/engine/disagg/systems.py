"""Start whole local systems (router + pools as real processes) for a method."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from epd_engine.bench.static_system import LaunchSpec, LocalSystem
from epd_engine.config import Method, Role
from epd_engine.contracts.plan import Budgets, Plan
from epd_engine.local.ports import free_port

# one KV layer per group: the tiny model has 2 layers, so every KV pull is multi-group
ENGINE_ARGS = [
    "--num-kv-blocks", "256", "--num-image-blocks", "16", "--max-num-running", "16",
    "--kv-layers-per-group", "1",
]  # fmt: skip
BUDGETS = Budgets(token_budget=256, image_budget=4)


def plan_for(method: Method, pools: dict[str, int]) -> Plan:
    roles = {role: pools.get(role.value, 1) for role in method.roles}
    return Plan(method=method, pools=roles, budgets={r: BUDGETS for r in roles})


@contextmanager
def local_system(
    model_dir: Path,
    run_dir: Path,
    plan: Plan,
    instance_env: dict[str, str] | None = None,
    instance_timeout_s: float = 3.0,
    transfer_backend: str = "auto",
    engine_args: tuple[str, ...] = (),
    role_args: dict[Role, list[str]] | None = None,
    progress_timeout_s: float = 60.0,
    supervised: bool = False,
    device: str = "cpu",
    base_args: Sequence[str] = ENGINE_ARGS,  # fewer: the engine's own sizing (large images)
) -> Iterator[LocalSystem]:
    spec = LaunchSpec(
        name="test",
        model_name="tiny-llava",
        model_dir=model_dir,
        plan=plan,
        router_port=free_port(),
        run_dir=run_dir,
        engine_args=[*base_args, "--transfer-backend", transfer_backend, *engine_args],
        role_args=role_args or {},
        instance_env=instance_env or {},
        instance_timeout_s=instance_timeout_s,
        progress_timeout_s=progress_timeout_s,
        device=device,
    )
    system = LocalSystem(spec)
    system.start()
    try:
        system.wait_ready(timeout_s=240)
        if supervised:  # crashed children come back, as under `epdctl up`
            system.supervise_in_background()
        yield system
    finally:
        system.stop()
