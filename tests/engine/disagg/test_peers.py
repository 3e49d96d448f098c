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
from epd_engine.disagg import offers
from epd_engine.disagg.peers import Peers
from epd_engine.metrics import Metrics
from epd_engine.request import CacheKind

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
    monkeypatch.setattr(offers, "TARGET_WAIT_S", 0.2)
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


async def test_a_hand_off_stays_in_the_group_until_its_peer_is_beyond_the_bound() -> None:
    """contracts/group_locality.py in the source's choice, counted by locality: group A's P
    over group B's equally idle one (which sorts first), B's once A's has a request waiting
    while B's would run it now."""
    me = InstanceLoad(
        instance_id="e-a", url="http://e-a", role=Role.E, pool="e", node="boot", group="a"
    )

    def p(name: str, group: str, waiting: int = 0) -> InstanceLoad:
        return InstanceLoad(
            instance_id=name, url=f"http://{name}", role=Role.P, pool="p", num_waiting=waiting,
            node="boot", group=group,
        )  # fmt: skip

    async def take(target: InstanceLoad, offer: Any) -> bool:
        return True

    metrics = Metrics("m", "E", "e")
    offer: Any = SimpleNamespace(routing=SimpleNamespace(affinity_key=None), kind=CacheKind.IMAGE)
    chosen = []
    for mine in (p("p-a", "a"), p("p-a", "a", waiting=1)):
        link = SimpleNamespace(identity=me, instances=[me, p("p-b", "b"), mine], heartbeat_s=0.05)
        source = Peers(link, backend=None, http=None, token="t", metrics=metrics)  # type: ignore[arg-type]
        source._send_offer = take  # type: ignore[method-assign]
        target = await source.place(offer, Stage.PREFILL)
        assert target is not None
        chosen.append(target.instance_id)
    assert chosen == ["p-a", "p-b"]
    counted = {
        where: metrics.registry.get_sample_value(
            "epd_handoffs_total", {**metrics.labels, "kind": "image", "locality": where}
        )
        for where in ("group", "node")
    }
    assert counted == {"group": 1.0, "node": 1.0}
