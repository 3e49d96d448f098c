"""When a router replica is Ready (its Service, or the local balancer, sends it clients).

Always: some registered instance can start a text request (every plan has one), or a
client would get 503 "no ready instance can run prefill". At start, also: every pool of the
routing it started with has an instance registered, for up to a grace period. A replica
restarted under E+P+D hears from the prefill instance first as often as not, and was Ready
while image requests failed for want of the encoder's heartbeat; after the grace (or once
Ready) a missing pool no longer holds it out, so a dead encode pool never stops text traffic.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from epd_engine.contracts.routing_policy import InstanceLoad, entry_candidates


def readiness(
    instances: Sequence[InstanceLoad],
    active_pools: Collection[str] | None,
    waiting_for_pools: bool,
) -> tuple[bool, dict[str, object]]:
    """(ready, what /health/ready answers). ``waiting_for_pools``: the replica has never
    been Ready and is within its start-up grace."""
    if not instances:
        return False, {"status": "no instances registered"}
    if not entry_candidates(instances, has_images=False):
        return False, {"status": "no registered instance runs prefill", "instances": len(instances)}
    if waiting_for_pools and active_pools is not None:
        missing = sorted(set(active_pools) - {load.pool for load in instances})
        if missing:
            return False, {"status": "active pools not registered yet", "pools": missing}
    return True, {"status": "ready", "instances": len(instances)}
