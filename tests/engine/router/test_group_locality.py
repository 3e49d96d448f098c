"""Hand-off targets in the source's placement group first, bounded by load
(contracts/group_locality.py): pure policy, no processes."""

from __future__ import annotations

from dataclasses import replace

from epd_engine.config import Role
from epd_engine.contracts.affinity import Affinity, PrefixAffinity, preferred
from epd_engine.contracts.group_locality import Locality, choose_handoff, locality
from epd_engine.contracts.routing_policy import InstanceLoad

NODE = "boot-a"


def peer(name: str, group: str = "", waiting: int = 0, running: int = 0) -> InstanceLoad:
    return InstanceLoad(
        instance_id=name, url=f"http://{name}", role=Role.P, pool="p", num_waiting=waiting,
        num_running=running, node=NODE, group=group,
    )  # fmt: skip


SOURCE = InstanceLoad(
    instance_id="e-a", url="http://e-a", role=Role.E, pool="e", node=NODE, group="pod-a"
)


def test_the_groups_peer_is_taken_over_an_equally_loaded_one_of_another_group() -> None:
    other, mine = peer("a-other", "pod-b", running=1), peer("z-mine", "pod-a", running=1)
    # the same node, the same load: without groups the id order picks the other group's
    ungrouped = replace(SOURCE, group="")
    assert choose_handoff(PrefixAffinity(), [other, mine], None, ungrouped).target is other
    choice = choose_handoff(PrefixAffinity(), [other, mine], None, SOURCE)
    assert (choice.target, choice.affinity) == (mine, None)
    assert locality(SOURCE, choice.target) is Locality.GROUP


def test_the_group_comes_before_the_affinity_key_within_the_bound() -> None:
    peers = [peer("p1", "pod-b"), peer("p2", "pod-b"), peer("p3", "pod-a")]
    key = next(k for k in map(str, range(100)) if preferred(peers, k).group == "pod-b")
    assert choose_handoff(PrefixAffinity(), peers, key, SOURCE).target.instance_id == "p3"


def test_a_group_peer_beyond_the_bound_gives_the_usual_choice() -> None:
    idle = peer("idle", "pod-b")
    for busy in (peer("mine", "pod-a", waiting=1), peer("mine", "pod-a", running=3)):
        choice = choose_handoff(PrefixAffinity(), [busy, idle], None, SOURCE)
        assert (choice.target, choice.affinity) == (idle, Affinity.NONE)
        assert locality(SOURCE, choice.target) is Locality.NODE
    # within the slack (max(2, 0.25 x 8)): still the group's
    mine, other = peer("mine", "pod-a", running=10), peer("o", "pod-b", running=8)
    assert choose_handoff(PrefixAffinity(), [mine, other], None, SOURCE).target is mine


def test_no_group_is_never_a_group_and_the_heartbeat_carries_it() -> None:
    ungrouped = peer("x")
    assert locality(ungrouped, peer("y")) is Locality.NODE  # both "": not one group
    assert locality(SOURCE, InstanceLoad("r", "http://r", Role.P, "p")) is Locality.REMOTE
    assert "group" not in ungrouped.to_json()  # a router of an earlier version sees no key
    grouped = peer("g", "pod-a", running=2)
    assert InstanceLoad.from_json(grouped.to_json()) == grouped
