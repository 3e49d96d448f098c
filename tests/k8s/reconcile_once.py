"""One reconcile pass of the real controller against the real API server, in this process.

The kopf timer (handlers.py) does the same per resync; calling the controller directly keeps
these tests fast and deterministic. The status is written through the status subresource.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
