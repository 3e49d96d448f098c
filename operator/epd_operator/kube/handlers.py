"""Thin kopf handlers: ``kopf run -m epd_operator.kube.handlers --all-namespaces --standalone``.

One level-triggered timer per EPDDeployment calls ``controller.reconcile`` (which re-reads the
cluster each time) and writes the status it returns: every ``resync_s``, and every
``rollout_resync_s`` while a rollout is in progress or the spec changed (``pass_due``).
Handlers never sleep: transient API errors become ``kopf.TemporaryError`` and the timer comes
back; errors a retry cannot fix (400, 403, 422) become a Degraded condition
(``api_errors.py``) until the next pass.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import kopf
from kubernetes import config as kube_config
from kubernetes.client.exceptions import ApiException

from epd_operator.api.spec import GROUP, PLURAL, VERSION
from epd_operator.kube import api_errors, controller, operator_metrics
from epd_operator.kube.client import Kube
from epd_operator.kube.controller import reconcile
from epd_operator.kube.settings import OperatorSettings

SETTINGS = OperatorSettings.from_env()
_kube: Kube | None = None


def _client() -> Kube:
    global _kube
    if _kube is None:
        try:
            kube_config.load_incluster_config()
        except kube_config.ConfigException:
            kube_config.load_kube_config()
        _kube = Kube()
    return _kube


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = f"{GROUP}/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.scanning.disabled = True  # no list/watch on CRDs and namespaces needed
    settings.posting.level = logging.WARNING  # only warnings become events from kopf's logs
    settings.watching.server_timeout = 120
    # A sync timer mid-pass cannot exit instantly on deletion: re-check soon, not in 60 s,
    # so the finalizer goes (and garbage collection starts) within seconds.
    settings.background.cancellation_polling = 2
    _client()
    operator_metrics.serve(SETTINGS.metrics_port)


_last_pass: dict[str, float] = {}  # uid -> monotonic time of its last pass


@kopf.timer(GROUP, VERSION, PLURAL, interval=SETTINGS.timer_interval_s, id="reconcile")
def reconcile_timer(
    body: kopf.Body,
    meta: kopf.Meta,
    spec: kopf.Spec,
    status: kopf.Status,
    name: str,
    namespace: str | None,
    uid: str,
    patch: kopf.Patch,
    **_: Any,
) -> None:
    if meta.get("deletionTimestamp"):
        _last_pass.pop(uid, None)
        controller.forget(uid)
        return  # children go with their owner (garbage collection)
    now = time.monotonic()
    due = SETTINGS.pass_due(status, int(meta.get("generation", 0)), _last_pass.get(uid), now)
    if not due and not controller.replan_finished(uid):
        return  # between resyncs, no rollout in progress, no re-plan to take

    def post_event(type_: str, reason: str, message: str) -> None:
        kopf.event(body, type=type_, reason=reason, message=message)

    raw_status = {k: v for k, v in status.items() if k != "kopf"}
    try:
        new_status = reconcile(
            _client(),
            name=name,
            namespace=namespace or "default",
            uid=uid,
            generation=int(meta.get("generation", 0)),
            raw_spec=dict(spec),
            raw_status=raw_status,
            post_event=post_event,
            router_timeout_s=SETTINGS.router_timeout_s,
            plan_timeout_s=SETTINGS.plan_timeout_s,
            plan_max_requests=SETTINGS.plan_max_requests,
            router_urls=SETTINGS.router_urls,
            checkpoint=SETTINGS.checkpoint,
        )
    except ApiException as exc:
        operator_metrics.RECONCILES.labels(namespace or "default", name, "api_error").inc()
        if api_errors.reason_of(exc) is None:
            raise kopf.TemporaryError(f"API error {exc.status}: {exc.reason}", delay=5) from exc
        generation = int(meta.get("generation", 0))
        new_status = api_errors.report(raw_status, exc, generation, post_event)
    patch.status.update(new_status)
    _last_pass[uid] = now  # a pass that raised is due again at the next tick
