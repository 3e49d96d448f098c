"""Where an instance finds the router replicas it must register with.

Given URLs are replicas as they are (``--router-url``, repeated or a comma list). With
``resolve`` each URL's host names every replica instead — a Kubernetes headless Service,
whose DNS answers one address per router pod — and each address becomes a URL of its own,
so the instance reaches every replica, not one the Service picked.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

# host, port -> the host's addresses (a seam for tests: loopback has one)
Resolver = Callable[[str, int], Awaitable[list[str]]]


def split_urls(values: Sequence[str]) -> list[str]:
    """``--router-url`` values, each possibly a comma list, as a list of URLs."""
    return [u.strip().rstrip("/") for v in values for u in v.split(",") if u.strip()]


async def resolve_addresses(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


class RouterDirectory:
    def __init__(
        self, urls: Sequence[str], resolve: bool = False, resolver: Resolver | None = None
    ) -> None:
        if not urls:
            raise ValueError("at least one router URL is needed")
        self.urls = [u.rstrip("/") for u in urls]
        self.resolve = resolve
        self.resolver = resolver or resolve_addresses

    async def replicas(self) -> list[str]:
        """Every replica's URL now; a name that does not resolve gives none this time."""
        if not self.resolve:
            return list(self.urls)
        found: list[str] = []
        for url in self.urls:
            parts = urlsplit(url)
            host, port = (
                parts.hostname or "",
                parts.port or (443 if parts.scheme == "https" else 80),
            )
            try:
                addresses = await self.resolver(host, port)
            except OSError as exc:  # no router pod yet, or DNS away for a moment
                log.warning("cannot resolve router replicas of %s: %r", url, exc)
                continue
            for address in addresses:
                shown = f"[{address}]" if ":" in address else address  # IPv6
                found.append(f"{parts.scheme}://{shown}:{port}{parts.path}")
        return list(dict.fromkeys(found))
