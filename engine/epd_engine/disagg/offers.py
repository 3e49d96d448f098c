"""Offering a request to the next stage: the peers that can take it, and the offer itself.
Shared by the real instance (``peers.py``) and the emulated one (``emulate/migration.py``),
so it imports no torch."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Protocol

import httpx

from epd_engine.config import Stage
from epd_engine.contracts.routing_policy import InstanceLoad
from epd_engine.transfer.messages import MigrationOffer

log = logging.getLogger(__name__)
TARGET_WAIT_S = 5.0


class PeerTable(Protocol):
    """What finding targets reads of the router link (``hooks.RouterPort`` has it all, but
    imports the engine: an emulated instance must not)."""

    @property
    def identity(self) -> InstanceLoad: ...

    @property
    def instances(self) -> Sequence[InstanceLoad]: ...

    @property
    def heartbeat_s(self) -> float: ...


async def stage_targets(link: PeerTable, stage: Stage) -> list[InstanceLoad]:
    """Peers that run ``stage``. An empty table waits a little: an instance learns of its
    peers from heartbeat answers, so one that just started may not know them yet."""
    deadline = time.monotonic() + TARGET_WAIT_S
    while True:
        me = link.identity.instance_id
        found = [i for i in link.instances if i.role.runs(stage) and i.instance_id != me]
        if found or time.monotonic() >= deadline:
            return found
        await asyncio.sleep(link.heartbeat_s / 2)


async def send_offer(
    http: httpx.AsyncClient, headers: dict[str, str], target: InstanceLoad, offer: MigrationOffer
) -> bool:
    """POST ``offer`` to ``target``; True once it accepted (a refusal or an error is logged)."""
    try:
        response = await http.post(
            f"{target.url}/internal/migrations",
            json=offer.model_dump(mode="json"),
            headers=headers,
            timeout=10.0,
        )
    except httpx.HTTPError as exc:
        log.warning("offer of %s to %s failed: %r", offer.request_id, target.url, exc)
        return False
    if response.status_code != 200:
        log.warning("%s refused %s: %s", target.url, offer.request_id, response.text[:200])
    return response.status_code == 200
