"""The link a deployment's migrations use: each transfer backend's per-transfer latency and
bandwidth as ``epdctl profile-costs`` measured them, and which backend a deployment's
``transferBackend`` resolves to (no torch here: the operator plans with it)."""

from __future__ import annotations

from dataclasses import dataclass

MEASURED_BACKENDS = ("tcp", "shm", "collective")
# Between two nodes (a NIC): ``links[NETWORK_LINK]`` in a cost model, where measured (one
# machine cannot measure it). Without it a cross-node pair is charged as a pair on one node.
NETWORK_LINK = "network"


@dataclass(frozen=True)
class LinkCoeffs:
    """One backend on one machine: a transfer costs ``latency_s + bytes / bytes_per_s``."""

    latency_s: float
    bytes_per_s: float

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.bytes_per_s <= 0:
            raise ValueError(f"a link needs latency >= 0 and bandwidth > 0, got {self}")


def link_backend(backend: str, same_host: bool = True) -> str:
    """The backend transfers really use. ``auto`` maps a same-host peer's memory (``shm``) and
    uses ``tcp`` otherwise, as ``transfer/auto.py`` decides per peer; pods count as separate
    hosts (each has its own network namespace, where the peer's socket is out of reach)."""
    if backend == "auto":
        return "shm" if same_host else "tcp"
    return backend


def fit_link(
    page_bytes: int, page_s: float, bulk_bytes: int, bulk_transfers: int, bulk_s: float
) -> LinkCoeffs:
    """Latency and bandwidth from a one-page transfer and a bulk pull of ``bulk_transfers``
    transfers: ``page_s = L + page_bytes / bw`` and ``bulk_s = n L + bulk_bytes / bw``.
    When noise makes the bulk pull look cheaper than its transfers' fixed costs, the bulk
    pull alone sets the bandwidth (an underestimate, never a negative or infinite one)."""
    spread = bulk_s - bulk_transfers * page_s
    moved = bulk_bytes - bulk_transfers * page_bytes
    bytes_per_s = moved / spread if spread > 0 and moved > 0 else bulk_bytes / bulk_s
    latency_s = max(0.0, page_s - page_bytes / bytes_per_s)
    return LinkCoeffs(latency_s=latency_s, bytes_per_s=bytes_per_s)
