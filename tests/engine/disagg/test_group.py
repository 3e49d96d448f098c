"""A placement group (``epdctl group``): the E, P and D instances of an E+P+D slice run as
members of one supervisor process, as they would in one pod, and migrate over shared memory:
the tokens are one EPD instance's; a member that dies takes the group down with its status."""

from __future__ import annotations

import asyncio
import shlex
import sys
import time
from pathlib import Path

import pytest

from epd_engine.bench.static_system import LaunchSpec, LocalSystem, instances
from epd_engine.cli import UserError
from epd_engine.commands.group import Group, member_commands
from epd_engine.config import Method
from epd_engine.local.ports import free_port
from tests.engine.disagg.systems import ENGINE_ARGS, plan_for
from tests.engine.disagg.test_methods import pull_backends
from tests.engine.disagg.workload import run_all

pytestmark = pytest.mark.slow


def test_a_group_of_e_p_d_members_gives_epd_tokens_over_shm(
    tiny_model_dir: Path, tmp_path: Path, reference: dict[str, str]
) -> None:
    spec = LaunchSpec(
        name="group",
        model_name="tiny-llava",
        model_dir=tiny_model_dir,
        plan=plan_for(Method.E_P_D, {}),
        router_port=free_port(),
        run_dir=tmp_path,
        engine_args=[*ENGINE_ARGS, "--transfer-backend", "auto"],
    )
    system = LocalSystem(spec)
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    (spec.run_dir / "plan.json").write_text(spec.plan.model_dump_json(indent=2))
    system._start_routers()
    system.planned = instances(spec)  # the three members' `serve` command lines
    members = [a for i in system.planned for a in ("--member", shlex.join(i.args))]
    group = system._start("group", ["group", *members, "--stop-timeout", "10"])
    try:
        system.wait_ready(timeout_s=420, on_progress=lambda n, want: print(f"{n}/{want} ready"))
        outputs = asyncio.run(run_all(f"{spec.router_url}/v1"))
        assert outputs == reference
        assert pull_backends(spec.router_url) == {"shm"}  # inside the group: shared memory
    finally:
        system.stop()
    assert group.popen.returncode is not None


def _member(marker: Path, exit_code: int | None = None) -> list[str]:
    """A stand-in member: records SIGTERM in ``marker`` and exits 0, or exits with
    ``exit_code`` on its own after a moment."""
    script = (
        "import pathlib, signal, sys, time\n"
        f"def bye(*_):\n    pathlib.Path({str(marker)!r}).write_text('term')\n    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        + (f"time.sleep(0.5)\nsys.exit({exit_code})\n" if exit_code is not None else "")
        + "time.sleep(60)\n"
    )
    return [sys.executable, "-c", script]


def test_a_member_that_exits_stops_the_others_with_its_status(tmp_path: Path) -> None:
    group = Group([_member(tmp_path / "a"), _member(tmp_path / "b", exit_code=3)], 10)
    assert group.wait() == 3
    assert (tmp_path / "a").read_text() == "term"  # the other member was told to stop
    assert all(m.poll() is not None for m in group.members)


def test_stopping_the_group_stops_every_member(tmp_path: Path) -> None:
    group = Group([_member(tmp_path / "a"), _member(tmp_path / "b")], 10)
    time.sleep(1.0)  # both installed their handlers
    group.stop()
    assert [(tmp_path / n).read_text() for n in "ab"] == ["term", "term"]
    assert [m.returncode for m in group.members] == [0, 0]


def test_member_arguments_are_serve_command_lines() -> None:
    [cmd] = member_commands(["serve --model '/m dir' --role E"])
    assert cmd[-5:] == ["serve", "--model", "/m dir", "--role", "E"]
    with pytest.raises(UserError):
        member_commands(["serve"])
