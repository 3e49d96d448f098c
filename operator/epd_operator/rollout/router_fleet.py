"""Every router replica, addressed one by one: a switch must reach all of them, and a drain
must count the requests in flight on all of them.

Through the router's Service a call reaches one replica, picked by the proxy; so the operator
asks for the replicas' own addresses (their pod IPs, or the local processes' ports) and calls
each. ``read`` gives the ``RouterView`` the rollout state machine decides on; ``switch`` PUTs
the new routing to every replica and returns the ones that did not take it (the next pass
reads them again and retries: status records only what the replicas read back).
"""

from __future__ import annotations

from collections.abc import Sequence

from epd_engine.contracts.plan import Plan
from epd_operator.rollout.router_api import RouterAPI
from epd_operator.rollout.state_machine import RouterView


class RouterFleet:
    def __init__(self, addresses: Sequence[str], token: str, timeout_s: float = 2.0) -> None:
        self.replicas = [RouterAPI(a, token, timeout_s) for a in addresses]

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(r.base_url for r in self.replicas)

    def read(self) -> RouterView:
        routing: dict[str, frozenset[str] | None] = {}
        in_flight: dict[str, int] = {}
        for replica in self.replicas:
            state = replica.pools_state()
            if state is None:
                continue
            routing[replica.base_url] = state.routing
            for pool, count in state.in_flight.items():
                in_flight[pool] = in_flight.get(pool, 0) + count
        return RouterView(self.addresses, routing, in_flight)

    def switch(
        self, pools: frozenset[str], plan: Plan | None, view: RouterView | None = None
    ) -> list[str]:
        """Send new requests to ``pools`` on every replica whose routing (in ``view``) differs;
        returns the addresses that did not accept it."""
        failed = []
        for replica in self.replicas:
            if view is not None and view.routing.get(replica.base_url, None) == pools:
                continue
            if not replica.set_routing(sorted(pools), plan):
                failed.append(replica.base_url)
        return failed
