"""The kube controller re-plans beside its passes (issue 32), as the local loop does.

Defect prevented: the controller ran a due re-plan inside the reconcile pass, so the pass --
and with it every rollout step and fast-path step of that EPDDeployment -- waited for the
trace read and the replay (39-151 s for a 16-GPU fleet in ``make bench-elastic``). Now the
pass that finds a re-plan due starts it in the background and returns with the current plan;
the pass after it ended takes it, and the kopf timer runs that pass at its next tick rather
than at the next resync (``controller.replan_finished``).

The real controller against the real API server, no operator process (this module starts
none), one pass at a time (``reconcile_once``). The router is a stand-in, a plain HTTP server
on loopback whose trace endpoint answers after ``TRACE_DELAY_S`` (a long trace read, which a
test cannot get from a real router without minutes of traffic) and whose other endpoints
answer 503 at once; the re-plan thus finds no trace and keeps the plan, which is enough to
show where it ran.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler

import pytest
from kubernetes import client

from epd_operator.api.spec import GROUP, PLURAL, VERSION
from epd_operator.kube import controller
from tests.k8s.conftest import ROOT, Cluster
from tests.k8s.reconcile_once import Pass, loopback_router

pytestmark = pytest.mark.k8s
NAME = "qwen2-vl"  # examples/k8s/epd-auto.yaml
LONG_AGO = "2020-01-01T00:00:00Z"
TRACE_DELAY_S = 3.0


class SlowTrace(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path.startswith("/v1/trace"):
            time.sleep(TRACE_DELAY_S)
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def slow_router() -> Iterator[str]:
    with loopback_router(SlowTrace) as url:
        yield url


def test_a_due_re_plan_runs_beside_the_passes_and_the_next_pass_takes_it(
    cluster: Cluster, crd: None, namespace: str, slow_router: str
) -> None:
    example = ROOT / "examples" / "k8s" / "epd-auto.yaml"
    cluster.kubectl("apply", "-n", namespace, "-f", str(example))
    api = cluster.api_client()
    custom = client.CustomObjectsApi(api)
    obj = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, NAME)
    uid = obj["metadata"]["uid"]
    run = Pass(api, router_urls=(slow_router,))

    first = run(namespace, NAME)  # no plan yet: planned in the pass
    assert first["plan"]["revision"] == 1 and first["lastPlanned"]
    assert not controller.replan_finished(uid)

    # the last plan an interval ago: a re-plan is due
    custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, NAME, {"status": {"lastPlanned": LONG_AGO}}
    )
    second = run(namespace, NAME)
    search = controller._SEARCHES.get(uid)
    assert search is not None and search.running, "the pass ran the re-plan itself"
    assert second["lastPlanned"] == LONG_AGO and second["plan"] == first["plan"]

    assert search.wait(TRACE_DELAY_S + 30) and controller.replan_finished(uid)
    run(namespace, NAME)  # takes it
    assert not controller.replan_finished(uid) and not search.running
    run(namespace, NAME)  # still due (the re-plan found no trace): the next one starts
    assert search.running
    cluster.kubectl("delete", "epd", NAME, "-n", namespace, "--wait=true", "--timeout=60s")
    search.wait(TRACE_DELAY_S + 30)
    controller.forget(uid)
