"""A migration source picks targets from the peer table its heartbeats bring back.

The router link is a stand-in (``SimpleNamespace``): only the table and the heartbeat
period matter here, and a real startup race cannot be timed reliably. The real
processes are covered by ``tests/engine/disagg``.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from epd_engine.config import Role, Stage
from epd_engine.contracts.routing_policy import InstanceLoad
from epd_engine.disagg import peers
from epd_engine.disagg.peers import Peers

ME = InstanceLoad(instance_id="e-0", url="http://e-0", role=Role.E, pool="e")
PD = InstanceLoad(instance_id="pd-0", url="http://pd-0", role=Role.PD, pool="pd")
OTHER_E = InstanceLoad(instance_id="e-1", url="http://e-1", role=Role.E, pool="e")


def table(instances: list[InstanceLoad]) -> tuple[Peers, Any]:
    link = SimpleNamespace(identity=ME, instances=instances, heartbeat_s=0.05)
    return Peers(link, backend=None, http=None, token="t"), link  # type: ignore[arg-type]


async def test_targets_run_the_next_stage_and_exclude_the_source() -> None:
    known, _ = table([ME, OTHER_E, PD])
    assert await known.targets(Stage.PREFILL) == [PD]
    assert await known.targets(Stage.ENCODE) == [OTHER_E]


async def test_a_fresh_source_waits_for_the_heartbeat_that_brings_its_peers() -> None:
    known, link = table([ME])

    async def heartbeat_answer() -> None:
        await asyncio.sleep(0.3)
        link.instances = [ME, PD]

    task = asyncio.create_task(heartbeat_answer())
    assert await known.targets(Stage.PREFILL) == [PD]
    await task


async def test_no_peer_at_all_gives_up_after_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peers, "TARGET_WAIT_S", 0.2)
    known, _ = table([ME])
    assert await known.targets(Stage.PREFILL) == []
