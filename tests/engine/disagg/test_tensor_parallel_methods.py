"""A tensor-parallel instance inside a disaggregated deployment (issue 34): through the real
router, with real processes, E+PD with its PD instance split over two ranks (images encoded
on E migrate into rank 0's image cache, and every rank reads them from there) and EPD at
TP=2 give the tokens one plain EPD instance gives (greedy).

KV caches move between instances of different sizes through rank 0's whole-head staging
pages (``parallel/kv_staging.py``): E+P+D with P at TP=2 and D at TP=1, and the reverse,
give those tokens too, over shared memory and over TCP, and every instance has all its
pages back afterwards."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from epd_engine.config import Method, Role
from tests.engine.disagg.leaks import assert_nothing_leaked
from tests.engine.disagg.systems import local_system, plan_for
from tests.engine.disagg.workload import run_all
from tests.processes import rank_pids

pytestmark = pytest.mark.slow
TWO_RANKS = ["--tensor-parallel-size", "2"]


@pytest.mark.parametrize(("method", "role"), [(Method.E_PD, Role.PD), (Method.EPD, Role.EPD)])
def test_a_two_rank_instance_gives_the_single_instance_tokens(
    tiny_model_dir: Path, tmp_path: Path, reference: dict[str, str], method: Method, role: Role
) -> None:
    plan = plan_for(method, {})
    with local_system(tiny_model_dir, tmp_path, plan, role_args={role: TWO_RANKS}) as system:
        assert len(rank_pids()) == 1  # the split instance's rank 1; no other instance has one
        outputs = asyncio.run(run_all(f"{system.spec.router_url}/v1"))
    assert outputs == reference
    assert all(reference.values())


@pytest.mark.parametrize(
    ("split", "backend"),
    [(Role.P, "shm"), (Role.D, "shm"), (Role.P, "tcp")],
    ids=["P-at-2-to-D-at-1-shm", "P-at-1-to-D-at-2-shm", "P-at-2-to-D-at-1-tcp"],
)
def test_caches_move_between_instances_of_different_sizes(
    tiny_model_dir: Path, tmp_path: Path, reference: dict[str, str], split: Role, backend: str
) -> None:
    plan = plan_for(Method.E_P_D, {})
    with local_system(
        tiny_model_dir, tmp_path, plan, transfer_backend=backend, role_args={split: TWO_RANKS}
    ) as system:
        assert len(rank_pids()) == 1
        outputs = asyncio.run(run_all(f"{system.spec.router_url}/v1"))
        assert_nothing_leaked(system)
    assert outputs == reference
