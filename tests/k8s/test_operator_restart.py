"""The operator killed in the middle of a method switch resumes from status and the cluster.

Five switches of one EPDDeployment (E+P+D -> EP+D -> E+PD -> ED+P -> EPD -> EPD 3), each
with the operator stopped at a different point of a rollout pass: right after it created the
new pools, after it PUT the new routing but before reading it back, after the read-back but
before writing status, after deleting the drained pools but before writing status (each by
``EPD_OPERATOR_EXIT_AT``, an immediate ``os._exit`` there), and SIGKILLed from outside while
status says ``Draining``. A fresh operator then completes each switch. Every switch brings
new pool names only (each also sets another ``numKvBlocks``: a role kept with the same
settings would be the same pool, resized in place), so a watch on the namespace's Deployments
shows whether anything was created twice, deleted twice, or deleted and created again.

Routers do not run on kwok: a real router process on loopback stands in for the router pods
(``LoopbackRouter``), so switches and read-backs go through its real internal API.
"""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import threading
import time
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from epd_operator.kube.settings import EXIT_AT_CODE
from epd_operator.rollout.driver import (
    POOLS_APPLIED,
    POOLS_DELETED,
    ROUTING_CONFIRMED,
    ROUTING_SENT,
)
from tests.k8s.conftest import (
    LOG_DIR,
    ROOT,
    Cluster,
    LoopbackRouter,
    start_operator,
    stop_operator,
    wait_until,
)

# five switches, each with two operator starts (kopf takes seconds to start on a busy host)
pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.timeout(1800)]

NAME = "restart"
KILLED_IN_DRAINING = "sigkill_in_draining"
# (method, pools, how the operator is stopped during the switch to it); each plan's pool
# names are new: no role has the same replica count in two plans
SWITCHES = [
    ("EP+D", {"EP": 2, "D": 2}, POOLS_APPLIED),
    ("E+PD", {"E": 2, "PD": 1}, ROUTING_SENT),
    ("ED+P", {"ED": 1, "P": 1}, ROUTING_CONFIRMED),
    ("EPD", {"EPD": 2}, POOLS_DELETED),
    ("EPD", {"EPD": 3}, KILLED_IN_DRAINING),
]


def manifest() -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "examples" / "k8s" / "epd-fixed-e-p-d.yaml").read_text())
    doc["metadata"]["name"] = NAME
    doc["spec"]["model"]["source"] = {"preset": "tiny-llava"}
    doc["spec"]["engine"]["resources"] = {"requests": {"cpu": "1", "memory": "1Gi"}}
    doc["spec"]["rollout"]["drainTimeoutSeconds"] = 300  # a drain must end by its count
    return doc


def status_of(cluster: Cluster, ns: str) -> dict[str, Any]:
    obj = cluster.get("epddeployment", NAME, "-n", ns) or {}
    return {**obj.get("status", {}), "generation": obj.get("metadata", {}).get("generation")}


def progressing(status: dict[str, Any]) -> str:
    for c in status.get("conditions", []):
        if c["type"] == "Progressing":
            return str(c["reason"])
    return ""


def engine_pools(cluster: Cluster, ns: str) -> dict[str, str]:
    """Engine Deployments not being deleted: name -> uid."""
    items = cluster.items("deployments", "-n", ns, "-l", "app.kubernetes.io/component=engine")
    return {
        d["metadata"]["name"]: d["metadata"]["uid"]
        for d in items
        if not d["metadata"].get("deletionTimestamp")
    }


def routing(router: LoopbackRouter, token: str) -> set[str] | None:
    answer = httpx.get(
        f"{router.url}/internal/pools", headers={"X-EPD-Token": token}, timeout=5
    ).json()
    active = answer.get("active_pools")
    return None if active is None else set(active)


class DeploymentWatch:
    """Every ADDED and DELETED of the namespace's engine Deployments, by name."""

    def __init__(self, cluster: Cluster, ns: str) -> None:
        from kubernetes import client, watch

        self.api = cluster.api_client()
        self.apps = client.AppsV1Api(self.api)
        self.watch = watch.Watch()
        self.ns = ns
        self.added: Counter[str] = Counter()
        self.deleted: Counter[str] = Counter()
        self.stopping = False
        self.error: Exception | None = None  # the watch broke while the test needed it
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        stream = self.watch.stream(
            self.apps.list_namespaced_deployment,
            self.ns,
            label_selector="app.kubernetes.io/component=engine",
            timeout_seconds=900,
        )
        try:
            for event in stream:
                name = event["object"].metadata.name
                if event["type"] == "ADDED":
                    self.added[name] += 1
                elif event["type"] == "DELETED":
                    self.deleted[name] += 1
        except Exception as exc:  # the connection closed under it when stopped is fine
            if not self.stopping:
                self.error = exc

    def __enter__(self) -> DeploymentWatch:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stopping = True
        self.watch.stop()
        self.api.close()
        self.thread.join(timeout=10)


def test_operator_killed_at_each_phase_of_a_switch_completes_it(
    cluster: Cluster, namespace: str, operator_kubeconfig: Path, loopback_router: LoopbackRouter
) -> None:
    ns = namespace
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log = LOG_DIR / "operator-restart.log"
    log.write_text("")
    cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump(manifest()))
    try:
        drill(cluster, ns, operator_kubeconfig, loopback_router, log)
    finally:  # no operator runs now to take its finalizer off: the namespace must go
        cluster.kubectl("patch", "epd", NAME, "-n", ns, "--type", "merge", "-p",
                        '{"metadata":{"finalizers":null}}', check=False)  # fmt: skip


def drill(
    cluster: Cluster, ns: str, operator_kubeconfig: Path, loopback_router: LoopbackRouter, log: Path
) -> None:
    def complete(generation: int) -> dict[str, Any] | None:
        s = status_of(cluster, ns)
        done = s.get("observedGeneration") == generation and progressing(s) == "RolloutComplete"
        return s if done else None

    def draining(generation: int) -> bool:
        s = status_of(cluster, ns)
        return s.get("observedGeneration") == generation and progressing(s) == "Draining"

    proc = start_operator(operator_kubeconfig, loopback_router.url, log)
    try:
        # the operator makes the token; kopf takes long to start on a busy host
        secret = f"{NAME}-internal-token"
        wait_until(secret, lambda: cluster.get("secret", secret, "-n", ns), 300, every_s=1)
        loopback_router.serve(cluster, ns, NAME)
        first = wait_until("the first plan complete", lambda: complete(1), 300)
    finally:
        stop_operator(proc)
    token = base64.b64decode(
        cluster.kubectl(
            "get", "secret", f"{NAME}-internal-token", "-n", ns, "-o", "jsonpath={.data.token}"
        ).stdout
    ).decode()
    router_uid = cluster.get("deployment", f"{NAME}-router", "-n", ns)["metadata"]["uid"]
    seen: list[dict[str, Any]] = []
    with DeploymentWatch(cluster, ns) as watched:
        time.sleep(1)  # the watch lists what exists (ADDED) before the first switch
        before = engine_pools(cluster, ns)
        assert set(before) == set(first["activePools"])
        for index, (method, pools, stop_at) in enumerate(SWITCHES):
            spec = cluster.get("epddeployment", NAME, "-n", ns)["spec"]
            # one merge patch (the CRD checks that pools match the method): null drops a role
            roles: dict[str, int | None] = dict.fromkeys(spec["disaggregation"]["pools"])
            patch = {
                "spec": {
                    "disaggregation": {"method": method, "pools": {**roles, **pools}},
                    "engine": {"numKvBlocks": 512 + 64 * index},  # every pool a new one
                }
            }
            cluster.kubectl("patch", "epd", NAME, "-n", ns, "--type", "merge", "-p",
                            json.dumps(patch))  # fmt: skip
            generation = status_of(cluster, ns)["generation"]
            if stop_at == KILLED_IN_DRAINING:
                proc = start_operator(operator_kubeconfig, loopback_router.url, log)
                try:
                    wait_until("status Draining", partial(draining, generation), 120, every_s=0.1)
                finally:
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
            else:
                env = {"EPD_OPERATOR_EXIT_AT": stop_at}
                proc = start_operator(operator_kubeconfig, loopback_router.url, log, env)
                try:
                    code = proc.wait(timeout=300)
                except subprocess.TimeoutExpired:
                    stop_operator(proc)
                    raise AssertionError(f"the operator never reached {stop_at}") from None
                assert code == EXIT_AT_CODE, (stop_at, code, log.read_text()[-3000:])
            at_stop = status_of(cluster, ns)
            cut: dict[str, Any] = {
                "stop_at": stop_at,
                "pools": engine_pools(cluster, ns),
                "routing": routing(loopback_router, token),
                "status_active": set(at_stop.get("activePools", [])),
                "observed": at_stop.get("observedGeneration"),
                "progressing": progressing(at_stop),
            }
            old = set(before)
            # each stop came where it was meant to: what was done, and not yet in status
            if stop_at == POOLS_APPLIED:
                assert cut["observed"] < generation, cut  # status not written after the change
                assert len(set(cut["pools"]) - old) == len(pools), cut
                assert cut["routing"] == old, cut
            elif stop_at in (ROUTING_SENT, ROUTING_CONFIRMED):
                assert cut["routing"] == set(cut["pools"]) - old, cut  # the new pools
                assert cut["status_active"] == old, cut  # status still has the old routing
            elif stop_at == POOLS_DELETED:
                assert not old <= set(cut["pools"]), cut  # some old pool is gone
                assert cut["progressing"] in ("Draining", "SwitchingRouting"), cut
            else:
                assert cut["progressing"] == "Draining", cut

            proc = start_operator(operator_kubeconfig, loopback_router.url, log)
            try:
                done = wait_until(
                    f"the switch to {method} complete after a stop at {stop_at}",
                    partial(complete, generation),
                    300,
                )
            finally:
                stop_operator(proc)
            after = engine_pools(cluster, ns)
            new = set(after)
            assert new.isdisjoint(old), (before, after)
            assert set(done["activePools"]) == new == routing(loopback_router, token)
            assert done["plan"]["method"] == method and done["readyPools"] == (
                f"{len(pools)}/{len(pools)}"
            )
            # the pools made before the stop are the ones serving: none was made twice
            for name, uid in cut["pools"].items():
                if name in new:
                    assert after[name] == uid, (name, cut["pools"], after)
            seen.append({**cut, "after": after})
            before = after
        time.sleep(2)  # the last deletions reach the watch

    # nothing created twice, nothing deleted twice, nothing left behind
    assert watched.error is None, watched.error  # it saw everything
    assert max(watched.added.values()) == 1, watched.added
    assert max(watched.deleted.values()) == 1, watched.deleted
    assert set(watched.added) - set(watched.deleted) == set(before), (watched.added, before)
    for kind in ("services", "poddisruptionbudgets"):
        items = cluster.items(kind, "-n", ns, "-l", "app.kubernetes.io/component=engine")
        names = {i["metadata"]["name"] for i in items if not i["metadata"].get("deletionTimestamp")}
        assert names == set(before), (kind, names, before)
    router = cluster.get("deployment", f"{NAME}-router", "-n", ns)
    assert router["metadata"]["uid"] == router_uid  # the router was never replaced
    events = cluster.items("events", "-n", ns, "--field-selector", f"involvedObject.name={NAME}")
    switched = [e["message"] for e in events if e["reason"] == "Switched"]
    for cut in seen:
        pools_named = ", ".join(sorted(cut["after"]))
        assert any(f"sends requests to {pools_named} " in m for m in switched), (cut, switched)
    assert "Traceback" not in log.read_text(), log.read_text()[-4000:]
