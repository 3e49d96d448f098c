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


async def test_a_hand_off_goes_to_a_peer_on_the_source_node_unless_it_is_busier() -> None:
    """contracts/node_locality.py in the source's choice: the same-node peer over an equally
    idle remote one (which the id order alone would pick), the idle remote one over a local
    peer with work queued."""
    me = InstanceLoad(instance_id="e-0", url="http://e-0", role=Role.E, pool="e", node="boot-a")

    def pd(name: str, node: str, waiting: int = 0) -> InstanceLoad:
        return InstanceLoad(
            instance_id=name, url=f"http://{name}", role=Role.PD, pool="pd", num_waiting=waiting,
            node=node,
        )  # fmt: skip

    offered: list[str] = []

    async def take(target: InstanceLoad, offer: Any) -> bool:
        offered.append(target.instance_id)
        return True

    offer: Any = SimpleNamespace(routing=SimpleNamespace(affinity_key=None))
    for instances, expected in (
        ([pd("pd-0", "boot-b"), pd("pd-1", "boot-a")], "pd-1"),
        ([pd("pd-0", "boot-b"), pd("pd-1", "boot-a", waiting=1)], "pd-0"),
    ):
        link = SimpleNamespace(identity=me, instances=[me, *instances], heartbeat_s=0.05)
        source = Peers(link, backend=None, http=None, token="t")  # type: ignore[arg-type]
        source._send_offer = take  # type: ignore[method-assign]
        target = await source.place(offer, Stage.PREFILL)
        assert target is not None and target.instance_id == expected
    assert offered == ["pd-1", "pd-0"]
