"""One instance's pull-based migrations, assembled (DESIGN.md §4).

Both sides share the transfer backend (the data plane), the peers and the background tasks:
``Source`` hands requests whose next stage lives elsewhere to a target and frees their pages
once pulled; ``Target`` queues offers, pulls when scheduled and recomputes on failure;
``Peers`` knows the other instances (target choice by cache affinity within a load bound,
connections to drop). The
engine is reached through ``EngineHooks``; the router link belongs to the app, and
migration uses it through ``RouterPort``.
"""

from __future__ import annotations

import httpx

from epd_engine.disagg.background import Background
from epd_engine.disagg.hooks import EngineHooks, RouterPort
from epd_engine.disagg.peers import Peers
from epd_engine.disagg.source import Source
from epd_engine.disagg.target import Target
from epd_engine.metrics import Metrics
from epd_engine.transfer.backend import Exports, TransferBackend


class Migration:
    """Built in a running event loop, before the engine starts; ``close`` on shutdown."""

    def __init__(
        self,
        hooks: EngineHooks,
        link: RouterPort,
        backend: TransferBackend,
        exports: Exports,
        http: httpx.AsyncClient,
        token: str,
        layers_per_group: int = 8,
        early_kv: bool = True,
        metrics: Metrics | None = None,
    ) -> None:
        self.backend = backend
        self.background = Background()
        self.peers = Peers(link, backend, http, token, metrics)
        self.source = Source(hooks, link, self.peers, backend, exports, self.background, early_kv)
        self.target = Target(
            hooks, link, self.peers, backend, self.background, http, token, layers_per_group,
            metrics,
        )  # fmt: skip
        hooks.connect(self.source, self.target)
        self.background.spawn(self.peers.watch(self.source.check_targets))

    async def close(self) -> None:
        await self.background.close()
        await self.backend.close()
