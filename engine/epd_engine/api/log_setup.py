"""How the engine, the emulator and the router log: one format, and the HTTP client's
per-request lines only at ``debug``. Each instance calls its routers twice a second
(heartbeats) and httpx logs every call at INFO, which buried everything else in a pod's log
(``kubectl logs`` showed two heartbeat lines a second and little more)."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str) -> None:
    """``level``: the ``--log-level`` flag (debug, info, warning, ...)."""
    logging.basicConfig(level=level.upper(), format=FORMAT)
    if logging.getLogger().level > logging.DEBUG:
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)
