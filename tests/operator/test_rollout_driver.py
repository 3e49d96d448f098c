"""The rollout pass against real router processes: every replica switched and read back.

The pools are an in-memory backend (no Kubernetes API server or engine runs in this test:
Deployments are covered by tests/k8s, engines by the switch-under-load test); the routers are
real ``epdctl router`` processes on loopback, two replicas addressed one by one.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from epd_engine.config import Method, Role
from epd_engine.contracts.plan import Plan
from epd_engine.local.ports import free_port
from epd_operator.kube import manifests as r
from epd_operator.kube.manifests import PoolSpec
from epd_operator.rollout.driver import CHECKPOINTS, RolloutState, rollout_pass
from epd_operator.rollout.router_fleet import RouterFleet
from epd_operator.rollout.state_machine import ObservedPool
from tests.operator.conftest import make_owner
from tests.operator.test_router_api import TOKEN, start_router, start_routers

OLD = Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 2, Role.D: 1})
NEW = Plan(method=Method.EP_D, pools={Role.EP: 2, Role.D: 2})
# the D pool is kept (same settings: the same pool, resized 1 -> 2); E and P are replaced
T0 = datetime(2026, 1, 1, tzinfo=UTC)

pytestmark = pytest.mark.slow


@dataclass
class MemoryPools:
    """Pools that are Ready from the pass after they were applied."""

    pools: dict[str, ObservedPool] = field(default_factory=dict)
    deleted: list[str] = field(default_factory=list)

    def observe_pools(self) -> dict[str, ObservedPool]:
        return dict(self.pools)

    def apply_pool(self, pool: PoolSpec) -> None:
        seen = self.pools.get(pool.name)
        self.pools[pool.name] = ObservedPool(
            pool.name, pool.role, pool.replicas, seen.ready if seen else 0, pool.gpus
        )

    def tick(self) -> None:
        for name, p in self.pools.items():
            self.pools[name] = ObservedPool(p.name, p.role, p.replicas, p.replicas, p.gpus)

    def delete_pool(self, name: str) -> None:
        del self.pools[name]
        self.deleted.append(name)


@dataclass
class Rollout:
    backend: MemoryPools
    fleet: RouterFleet
    state: RolloutState = field(default_factory=RolloutState)
    now: datetime = T0
    events: list[tuple[str, str, str]] = field(default_factory=list)

    def to(self, plan: Plan, passes: int) -> list[str]:
        """Run passes toward ``plan``; returns the Progressing reason of each."""
        desired = r.pool_specs(make_owner(), plan)
        reasons = []
        for _ in range(passes):
            outcome = rollout_pass(
                self.backend, self.fleet, desired, plan, self.state, self.now, 8, 600,
                lambda *e: self.events.append(e), settle_s=1,
            )  # fmt: skip
            self.state = outcome.state
            reasons.append(outcome.status.conditions["Progressing"].reason)
            self.backend.tick()
            self.now += timedelta(seconds=1)
        return reasons


def routing_of(url: str) -> list[str] | None:
    body = httpx.get(f"{url}/internal/pools", headers={"X-EPD-Token": TOKEN}).json()
    return body["active_pools"]


@pytest.fixture
def two_routers(tmp_path: Path) -> Iterator[list[str]]:
    with start_routers(tmp_path, 2) as urls:
        yield urls


def names(plan: Plan) -> set[str]:
    return {p.name for p in r.pool_specs(make_owner(), plan)}


def test_every_router_replica_is_switched_and_read_back(two_routers: list[str]) -> None:
    """Defect: with router.replicas > 1 the PUT and the in-flight read went through the
    Service to one replica. Each replica is now switched and read on its own address."""
    rollout = Rollout(MemoryPools(), RouterFleet(two_routers, TOKEN, timeout_s=5))
    assert rollout.to(OLD, 4)[-1] == "RolloutComplete"
    assert all(routing_of(u) == sorted(names(OLD)) for u in two_routers)
    reasons = rollout.to(NEW, 6)
    assert reasons[-1] == "RolloutComplete", reasons
    assert all(routing_of(u) == sorted(names(NEW)) for u in two_routers)
    assert set(rollout.backend.pools) == names(NEW)
    assert rollout.state.active_pools == names(NEW)
    switched = [m for _, reason, m in rollout.events if reason == "Switched"]
    assert len(switched) == 2 and all("replica (2)" in m or "(2)" in m for m in switched)


def test_a_replica_that_misses_the_switch_keeps_old_pools_until_it_confirms(
    tmp_path: Path, two_routers: list[str]
) -> None:
    """Defect: a routing PUT that failed was recorded as done and never retried. Now status
    keeps the last confirmed routing, nothing old is deleted, and the next passes retry until
    the missing replica (here: one that starts late) reads back the new routing."""
    late_port = free_port()
    late = f"http://127.0.0.1:{late_port}"
    rollout = Rollout(MemoryPools(), RouterFleet(two_routers, TOKEN, timeout_s=5))
    rollout.to(OLD, 4)
    rollout.fleet = RouterFleet([*two_routers, late], TOKEN, timeout_s=1)  # a third replica
    reasons = rollout.to(NEW, 5)
    assert set(reasons[-2:]) == {"RouterUnreachable"}, reasons
    assert rollout.state.active_pools == names(OLD)
    assert not rollout.backend.deleted
    assert any(reason == "RoutingNotConfirmed" for _, reason, _ in rollout.events)
    assert all(routing_of(u) == sorted(names(NEW)) for u in two_routers)  # they took it
    with start_router(tmp_path / "late", port=late_port):
        reasons = rollout.to(NEW, 6)
        assert routing_of(late) == sorted(names(NEW))
    assert reasons[-1] == "RolloutComplete", reasons
    assert set(rollout.backend.deleted) == names(OLD) - names(NEW)
    assert rollout.state.active_pools == names(NEW)


class Stopped(Exception):
    """The operator process ended here (what ``EPD_OPERATOR_EXIT_AT`` does with os._exit)."""


@pytest.mark.parametrize("stop_at", CHECKPOINTS)
def test_a_pass_cut_short_anywhere_is_completed_by_the_next(
    two_routers: list[str], stop_at: str
) -> None:
    """Level-triggered: a pass stopped after any of its actions, before its status was
    written, leaves a state the next passes (from the status before it) complete, deleting
    each old pool once and reporting the switch once."""
    rollout = Rollout(MemoryPools(), RouterFleet(two_routers, TOKEN, timeout_s=5))
    assert rollout.to(OLD, 4)[-1] == "RolloutComplete"
    rollout.events.clear()
    desired = r.pool_specs(make_owner(), NEW)
    reached = []

    def checkpoint(point: str) -> None:
        reached.append(point)
        if point == stop_at:
            raise Stopped(point)

    with pytest.raises(Stopped):
        for _ in range(8):  # the state is kept only by passes that end (as status)
            outcome = rollout_pass(
                rollout.backend, rollout.fleet, desired, NEW, rollout.state, rollout.now, 8,
                600, lambda *e: rollout.events.append(e), settle_s=1, checkpoint=checkpoint,
            )  # fmt: skip
            rollout.state = outcome.state
            rollout.backend.tick()
            rollout.now += timedelta(seconds=1)
    assert reached[-1] == stop_at
    rollout.backend.tick()
    rollout.now += timedelta(seconds=1)
    reasons = rollout.to(NEW, 6)
    assert reasons[-1] == "RolloutComplete", reasons
    assert sorted(rollout.backend.deleted) == sorted(names(OLD) - names(NEW))  # each once
    assert set(rollout.backend.pools) == names(NEW) == rollout.state.active_pools
    assert all(routing_of(u) == sorted(names(NEW)) for u in two_routers)
    switched = [m for _, reason, m in rollout.events if reason == "Switched"]
    assert len(switched) == 1, rollout.events
    assert ", ".join(sorted(names(NEW))) in switched[0]


def test_a_restarted_replica_is_given_the_routing_again(tmp_path: Path) -> None:
    """A router that restarts knows no routing (it sends to every registered pool); the next
    pass finds it disagreeing and PUTs the confirmed routing to it alone."""
    port = free_port()
    with start_router(tmp_path / "steady") as steady:
        urls = [steady, f"http://127.0.0.1:{port}"]
        with start_router(tmp_path / "first", port=port):
            rollout = Rollout(MemoryPools(), RouterFleet(urls, TOKEN, timeout_s=5))
            assert rollout.to(OLD, 4)[-1] == "RolloutComplete"
            assert routing_of(urls[1]) == sorted(names(OLD))
        with start_router(tmp_path / "again", port=port):
            assert routing_of(urls[1]) is None  # a fresh process: no routing yet
            rollout.events.clear()
            assert rollout.to(OLD, 1) == ["RolloutComplete"]
            assert routing_of(urls[1]) == sorted(names(OLD))
    assert [reason for _, reason, _ in rollout.events] == ["RoutingRestored"]
    assert urls[1] in rollout.events[0][2]
