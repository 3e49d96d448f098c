"""Fetching ``http(s)`` image URLs without becoming a proxy into the private network.

The encoder once fetched ``http://169.254.169.254/latest/meta-data``, loopback listeners
and the router's own internal routes for any client, downloaded 200 MB before checking the
size, and waited on a server dripping a byte every 2 s. Here:

- remote URLs are off unless hosts are allowed (``--allow-image-host``; ``*``: any host);
- the name is resolved once and every address checked: private, loopback, link-local,
  multicast, reserved and unspecified addresses are refused; the connection then goes to
  the checked address (a second lookup could answer differently);
- no redirects; connect, read and total timeouts; the body is streamed and cut at the cap;
- the client learns only that the image could not be fetched, never the upstream answer.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit, urlunsplit

import httpx

from epd_engine.contracts.errors import ClientError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class RemoteImagePolicy:
    allowed_hosts: tuple[str, ...] = ()  # () refuses every remote URL
    max_bytes: int = 20 * 1024 * 1024
    connect_timeout_s: float = 3.0
    read_timeout_s: float = 5.0  # between two reads
    total_timeout_s: float = 15.0

    def allows(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return any(
            allowed == "*"
            or host == allowed
            or (allowed.startswith(".") and host.endswith(allowed))
            for allowed in (h.lower().rstrip(".") for h in self.allowed_hosts)
        )


def is_internal(address: IPAddress) -> bool:
    """Addresses a client must never reach through us."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return (
        address.is_private
        or address.is_loopback
        or address.is_link_local
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
        or not address.is_global
    )


def _refused(message: str) -> ClientError:
    return ClientError(message, param="image_url", code="image_fetch_failed")


async def fetch_image(
    url: str,
    policy: RemoteImagePolicy,
    http: httpx.AsyncClient,
    refuse: Callable[[IPAddress], bool] = is_internal,
) -> bytes:
    """The bytes at ``url``, within ``policy``; a 400 ``ClientError`` for anything else."""
    parts = urlsplit(url)
    host = parts.hostname
    if parts.scheme not in ("http", "https") or not host:
        raise ClientError("image_url must be a data: or http(s) URL", param="image_url")
    if not policy.allowed_hosts:
        raise _refused("remote image URLs are off on this server; send the image as a data: URL")
    if not policy.allows(host):
        raise _refused(f"image host {host!r} is not allowed on this server")
    try:
        async with asyncio.timeout(policy.total_timeout_s):
            address = await _resolve(host, parts.port, policy, refuse)
            return await _download(parts, host, address, policy, http)
    except TimeoutError as exc:
        raise _refused(f"fetching the image from {host!r} timed out") from exc


async def _resolve(
    host: str, port: int | None, policy: RemoteImagePolicy, refuse: Callable[[IPAddress], bool]
) -> IPAddress:
    try:
        async with asyncio.timeout(policy.connect_timeout_s):
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port or 443, type=socket.SOCK_STREAM
            )
    except (OSError, UnicodeError) as exc:
        raise _refused(f"cannot resolve image host {host!r}") from exc
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    if not addresses or any(refuse(a) for a in addresses):
        raise _refused(f"image host {host!r} resolves to an address this server does not fetch")
    return addresses[0]


async def _download(
    parts: SplitResult,
    host: str,
    address: IPAddress,
    policy: RemoteImagePolicy,
    http: httpx.AsyncClient,
) -> bytes:
    literal = f"[{address}]" if address.version == 6 else str(address)
    netloc = f"{literal}:{parts.port}" if parts.port else literal
    pinned = urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
    host_header = f"{host}:{parts.port}" if parts.port else host
    timeout = httpx.Timeout(
        connect=policy.connect_timeout_s, read=policy.read_timeout_s, write=5.0, pool=5.0
    )
    failed = _refused(f"cannot fetch the image from {host!r}")
    try:
        async with http.stream(
            "GET",
            pinned,
            headers={"Host": host_header},
            timeout=timeout,
            follow_redirects=False,
            extensions={"sni_hostname": host},  # TLS still checks the name, not the address
        ) as response:
            if response.status_code != 200:
                raise failed  # no upstream status or body: they are not the client's business
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > policy.max_bytes:
                raise _refused(f"image is larger than {policy.max_bytes} bytes")
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > policy.max_bytes:
                    raise _refused(f"image is larger than {policy.max_bytes} bytes")
            return bytes(body)
    except httpx.TimeoutException as exc:
        raise _refused(f"fetching the image from {host!r} timed out") from exc
    except httpx.HTTPError as exc:
        raise failed from exc
