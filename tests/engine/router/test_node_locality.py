"""Migration targets on the source's node first, bounded by load (contracts/node_locality.py):
pure policy, no processes."""

from __future__ import annotations

import pytest

from epd_engine.config import Role
from epd_engine.contracts.node_locality import LocalFirst, LocalityBound, local_choice
from epd_engine.contracts.routing_policy import InstanceLoad, LeastLoaded

HERE, THERE = "boot-a", "boot-b"


def peer(name: str, node: str, waiting: int = 0, running: int = 0) -> InstanceLoad:
    return InstanceLoad(
        instance_id=name,
        url=f"http://{name}",
        role=Role.D,
        pool="d",
        num_waiting=waiting,
        num_running=running,
        node=node,
    )


def test_a_peer_on_the_node_is_taken_over_an_equally_loaded_remote_one() -> None:
    # the remote one sorts first by id: the plain policy would take it
    remote, local = peer("a-remote", THERE, running=3), peer("b-local", HERE, running=3)
    assert LeastLoaded().choose([remote, local]) is remote
    policy = LocalFirst(HERE)
    assert policy.choose([remote, local]) is local
    assert (policy.num_local, policy.num_remote) == (1, 0)


def test_within_the_bound_a_slightly_busier_local_peer_still_wins() -> None:
    remote, local = peer("r", THERE, running=8), peer("l", HERE, running=10)  # slack max(2, 2)
    assert LocalFirst(HERE).choose([remote, local]) is local
    busier = peer("l", HERE, running=11)
    assert LocalFirst(HERE).choose([remote, busier]) is remote


def test_never_a_busy_local_peer_while_another_is_idle() -> None:
    idle = peer("idle", THERE)
    assert LocalFirst(HERE).choose([idle, peer("l", HERE, running=3)]) is idle
    # a request waiting locally while the remote peer would run it now: remote
    assert LocalFirst(HERE).choose([idle, peer("l", HERE, waiting=1)]) is idle
    # two running locally is within the slack: still local (both run it at once)
    local = peer("l", HERE, running=2)
    assert LocalFirst(HERE).choose([idle, local]) is local


def test_the_least_loaded_of_several_local_peers() -> None:
    peers = [peer("l1", HERE, running=2), peer("l2", HERE, running=1), peer("r", THERE)]
    assert LocalFirst(HERE).choose(peers).instance_id == "l2"


def test_no_local_peer_or_unknown_node_falls_back_to_least_loaded() -> None:
    peers = [peer("r1", THERE, running=1), peer("r2", THERE)]
    policy = LocalFirst(HERE)
    assert policy.choose(peers).instance_id == "r2"
    assert (policy.num_local, policy.num_remote) == (0, 1)
    unknown = [peer("x", "", running=5), peer("y", THERE, running=1)]
    # an instance that does not report its node is never "local", even to a source that
    # does not know its own
    assert LocalFirst("").choose(unknown).instance_id == "y"
    assert local_choice(unknown, "", unknown[1]) is None


def test_bound_validates_and_the_choice_never_mutates_candidates() -> None:
    with pytest.raises(ValueError):
        LocalityBound(slack_requests=-1)
    peers = [peer("l", HERE, running=1), peer("r", THERE)]
    before = list(peers)
    LocalFirst(HERE).choose(peers)
    assert peers == before
    with pytest.raises(ValueError):
        LocalFirst(HERE).choose([])


def test_the_node_travels_in_the_heartbeat_and_is_left_out_when_unknown() -> None:
    load = peer("l", HERE, running=1)
    assert InstanceLoad.from_json(load.to_json()) == load
    assert "node" not in peer("x", "").to_json()  # a router of an earlier version sees no key
