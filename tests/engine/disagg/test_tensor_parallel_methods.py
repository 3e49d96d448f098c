"""A tensor-parallel instance inside a disaggregated deployment (issue 34): through the real
router, with real processes, E+PD with its PD instance split over two ranks (images encoded
on E migrate into rank 0's image cache, and every rank reads them from there) and EPD at
TP=2 give the tokens one plain EPD instance gives (greedy)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from epd_engine.config import Method, Role
from tests.engine.disagg.systems import local_system, plan_for
from tests.engine.disagg.workload import run_all

pytestmark = pytest.mark.slow
TWO_RANKS = ["--tensor-parallel-size", "2"]


def second_ranks() -> list[Path]:
    """The rank processes running on this host."""
    return [
        entry
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit() and _cmdline(entry).count(b"epd_engine.parallel.rank_main")
    ]


def _cmdline(entry: Path) -> bytes:
    try:
        return (entry / "cmdline").read_bytes()
    except OSError:
        return b""


@pytest.mark.parametrize(("method", "role"), [(Method.E_PD, Role.PD), (Method.EPD, Role.EPD)])
def test_a_two_rank_instance_gives_the_single_instance_tokens(
    tiny_model_dir: Path, tmp_path: Path, reference: dict[str, str], method: Method, role: Role
) -> None:
    plan = plan_for(method, {})
    with local_system(tiny_model_dir, tmp_path, plan, role_args={role: TWO_RANKS}) as system:
        assert len(second_ranks()) == 1  # the split instance's rank 1; no other instance has one
        outputs = asyncio.run(run_all(f"{system.spec.router_url}/v1"))
    assert outputs == reference
    assert all(reference.values())
