"""One reconcile pass of the real controller against the real API server, in this process.

The kopf timer (handlers.py) does the same per resync; calling the controller directly keeps
these tests fast and deterministic. The status is written through the status subresource.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from epd_operator.api.spec import GROUP, PLURAL, VERSION
from epd_operator.kube import api_errors
from epd_operator.kube.client import Kube
from epd_operator.kube.controller import reconcile


@dataclass
class Pass:
    api_client: Any
    events: list[tuple[str, str, str]] = field(default_factory=list)
    router_urls: tuple[str, ...] = ()  # the routers to ask (default: the router Service's)

    def post_event(self, type_: str, reason: str, message: str) -> None:
        self.events.append((type_, reason, message))

    def __call__(self, namespace: str, name: str) -> dict[str, Any]:
        """Reconcile ``namespace/name`` once (as the handler does, API errors included) and
        write the status; returns it."""
        custom = client.CustomObjectsApi(self.api_client)
        obj = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        meta, raw_status = obj["metadata"], obj.get("status") or {}
        generation = int(meta.get("generation", 0))
        try:
            status = reconcile(
                Kube(self.api_client), name=name, namespace=namespace, uid=meta["uid"],
                generation=generation, raw_spec=obj["spec"], raw_status=raw_status,
                post_event=self.post_event, router_timeout_s=0.2, router_urls=self.router_urls,
            )  # fmt: skip
        except ApiException as exc:
            if api_errors.reason_of(exc) is None:
                raise
            status = api_errors.report(raw_status, exc, generation, self.post_event)
        custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, {"status": status}
        )
        return status


def condition(status: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next(c for c in status.get("conditions", []) if c["type"] == ctype)


@contextmanager
def loopback_router(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """A stand-in router (``handler``) on loopback for the passes to ask; its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
