"""Fixtures for the end-to-end tests against the local control plane (tools/cluster/).

The session starts etcd + kube-apiserver + controller-manager + scheduler + kwok with
``tools/cluster/up.sh`` (or reuses one already up) and stops it afterwards if it started it.
Without the binaries (``make cluster-bins``) the tests skip with the reason, unless
``EPD_REQUIRE_K8S=1`` (CI), where they fail.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from epd_engine.local.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("EPD_CLUSTER_BIN", ROOT / ".build" / "bin"))
CLUSTER_DIR = Path(os.environ.get("EPD_CLUSTER_DIR", ROOT / ".build" / "cluster"))
LOG_DIR = ROOT / ".build" / "test-logs"
RELEASE = "epd-operator"
RELEASE_NAMESPACE = "epd-system"
REQUIRED = os.environ.get("EPD_REQUIRE_K8S") == "1"
BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
    "kubectl",
    "helm",
)


def _unavailable(reason: str) -> None:
    if REQUIRED:
        pytest.fail(f"EPD_REQUIRE_K8S=1 but the control plane is unavailable: {reason}")
    pytest.skip(reason)


@dataclass(frozen=True)
class Cluster:
    kubeconfig: Path

    def run(
        self, tool: str, *args: str, check: bool = True, timeout_s: float = 120
    ) -> subprocess.CompletedProcess:
        cmd = [str(BIN / tool), "--kubeconfig", str(self.kubeconfig), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
            )
        return proc

    def kubectl(
        self, *args: str, check: bool = True, stdin: str | None = None
    ) -> subprocess.CompletedProcess:
        cmd = [str(BIN / "kubectl"), "--kubeconfig", str(self.kubeconfig), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, input=stdin)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def get(self, *args: str) -> Any:
        """``kubectl get ... -o json`` parsed; None when a named object is not found."""
        proc = self.kubectl("get", *args, "-o", "json", "--ignore-not-found", check=True)
        return json.loads(proc.stdout) if proc.stdout.strip() else None

    def api_client(self) -> Any:
        """A kubernetes ApiClient (admin), for tight polling loops where kubectl is too slow."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def items(self, *args: str) -> list[dict[str, Any]]:
        """The items of ``kubectl get KIND ...`` (empty when there are none)."""
        found = self.get(*args)
        return list(found["items"]) if found else []


def wait_until(
    what: str, predicate: Callable[[], Any], timeout_s: float = 60, every_s: float = 0.25
) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; last value: {last!r}")


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    missing = [b for b in BINARIES if not (BIN / b).is_file()]
    if missing:
        _unavailable(
            f"control-plane binaries not built ({', '.join(missing)}); run `make cluster-bins`"
        )
    kubeconfig = CLUSTER_DIR / "kubeconfig"
    up = subprocess.run(
        [str(ROOT / "tools" / "cluster" / "up.sh")], capture_output=True, text=True, timeout=900
    )
    if up.returncode != 0:
        _unavailable(f"tools/cluster/up.sh failed:\n{up.stdout[-3000:]}\n{up.stderr[-3000:]}")
    started_here = "already up" not in up.stdout
    try:
        yield Cluster(kubeconfig)
    finally:
        if started_here and os.environ.get("EPD_KEEP_CLUSTER") != "1":
            subprocess.run([str(ROOT / "tools" / "cluster" / "down.sh")], check=False, timeout=60)


@pytest.fixture(scope="module")
def crd(cluster: Cluster) -> None:
    """The EPDDeployment CRD applied from crds/ and Established (for tests without the chart)."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    wait_until(  # `kubectl wait` fails on a CRD whose status has no conditions yet
        "the CRD's status",
        lambda: (
            (cluster.get("crd", "epddeployments.epd.serving.dev") or {})
            .get("status", {})
            .get("conditions")
        ),
    )
    cluster.kubectl(
        "wait", "--for", "condition=Established", "--timeout", "60s",
        "crd/epddeployments.epd.serving.dev",
    )  # fmt: skip


@pytest.fixture(scope="session")
def chart(cluster: Cluster) -> Iterator[str]:
    """``helm install`` the chart (CRD, RBAC, operator Deployment); returns the ServiceAccount."""
    cluster.run("helm", "uninstall", RELEASE, "-n", RELEASE_NAMESPACE, "--wait", check=False)
    cluster.run(
        "helm", "install", RELEASE, str(ROOT / "charts" / "epd-operator"),
        "-n", RELEASE_NAMESPACE, "--create-namespace", "--wait", "--timeout", "120s",
        "--set", "operator.resyncSeconds=1",
        timeout_s=180,
    )  # fmt: skip
    # helm installs a chart's CRDs only when they are missing: a cluster kept from an earlier
    # session would keep an older schema
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    cluster.kubectl(
        "wait", "--for", "condition=Established", "--timeout", "60s",
        "crd/epddeployments.epd.serving.dev",
    )  # fmt: skip
    yield RELEASE  # fullname == release name, so the ServiceAccount is called that too
    cluster.run("helm", "uninstall", RELEASE, "-n", RELEASE_NAMESPACE, check=False)


def _service_account_kubeconfig(
    cluster: Cluster, sa: str, namespace: str = RELEASE_NAMESPACE, name: str = "operator"
) -> Path:
    """A kubeconfig holding a token of the chart's ServiceAccount: the operator runs with
    exactly the chart's RBAC, as it would in its pod."""
    token = cluster.kubectl(
        "create", "token", sa, "-n", namespace, "--duration", "2h"
    ).stdout.strip()
    admin = cluster.kubectl("config", "view", "--raw", "-o", "json")
    server = json.loads(admin.stdout)["clusters"][0]["cluster"]
    path = CLUSTER_DIR / f"{name}.kubeconfig"
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": server}],
                "users": [{"name": "operator", "user": {"token": token}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "operator"}}],
                "current-context": "c",
            }
        )
    )
    return path


class LoopbackRouter:
    """A real router process on loopback standing in for the router pods, which kwok never
    runs: the operator (a local process) is pointed at it with ``EPD_OPERATOR_ROUTER_URLS``,
    so switches, read-backs and drains go through the real internal API. ``serve(ns, name)``
    restarts it with that EPDDeployment's internal token (the operator makes one per object)
    and its uid as the deployment id, as the router pods have them.
    """

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def serve(self, cluster: Cluster, ns: str, name: str) -> None:
        def token() -> str | None:
            secret = cluster.get("secret", f"{name}-internal-token", "-n", ns)
            data = (secret or {}).get("data") or {}
            return base64.b64decode(data["token"]).decode() if "token" in data else None

        value = wait_until(f"Secret {ns}/{name}-internal-token", token, 60)
        owner = cluster.get("epd", name, "-n", ns) or {}
        uid = owner.get("metadata", {}).get("uid", "")  # the id its router pods are given
        self.stop()
        config = CLUSTER_DIR / "loopback-router.json"
        config.write_text(json.dumps({"model": "any"}))
        log = (LOG_DIR / "loopback-router.log").open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "epd_engine", "router", "--config", str(config),
             "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning"],
            env={**os.environ, "EPD_INTERNAL_TOKEN": value, "EPD_DEPLOYMENT_ID": uid},
            stdout=log, stderr=log,
        )  # fmt: skip

        def live() -> bool | None:
            try:
                return httpx.get(f"{self.url}/health/live", timeout=1).status_code == 200 or None
            except httpx.HTTPError:
                return None

        wait_until("loopback router live", live, 120)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


@pytest.fixture(scope="session")
def loopback_router() -> Iterator[LoopbackRouter]:
    router = LoopbackRouter()
    try:
        yield router
    finally:
        router.stop()


def start_operator(
    kubeconfig: Path, router_url: str, log_path: Path, extra_env: dict[str, str] | None = None
) -> subprocess.Popen:
    """The operator as a local ``kopf run`` process (output appended to ``log_path``)."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "EPD_OPERATOR_RESYNC_S": "1",
        "EPD_OPERATOR_ROUTER_TIMEOUT_S": "0.5",
        "EPD_OPERATOR_ROUTER_URLS": router_url,
        **(extra_env or {}),
    }
    with log_path.open("a") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "kopf", "run", "-m", "epd_operator.kube.handlers",
             "--all-namespaces", "--standalone", "--verbose"],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
        )  # fmt: skip


def stop_operator(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def operator_kubeconfig(cluster: Cluster, chart: str) -> Path:
    """A kubeconfig with the chart's ServiceAccount token: the operator's RBAC exactly."""
    return _service_account_kubeconfig(cluster, chart)


@pytest.fixture(scope="module")  # gone before the real-pod tests start their operator pod
def operator(
    operator_kubeconfig: Path, loopback_router: LoopbackRouter
) -> Iterator[subprocess.Popen]:
    """The operator as a local ``kopf run`` process with the chart's ServiceAccount token."""
    log_path = LOG_DIR / "operator.log"
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log_path.write_text("")
    proc = start_operator(operator_kubeconfig, loopback_router.url, log_path)
    time.sleep(2)
    if proc.poll() is not None:
        raise AssertionError(f"operator exited at start:\n{log_path.read_text()[-4000:]}")
    try:
        yield proc
    finally:
        stop_operator(proc)


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    # a short digest of the whole id: parametrized tests share their first 40 characters, and
    # one namespace name meant each case waited ~5 s for the last case's to terminate
    digest = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:6]
    name = "e2e-" + request.node.name.removeprefix("test_").replace("_", "-")[:40].rstrip("-")
    name = f"{name}-{digest}"
    cluster.kubectl("delete", "namespace", name, "--ignore-not-found", "--wait=true")
    cluster.kubectl("create", "namespace", name)
    wait_until(
        "default ServiceAccount", lambda: cluster.get("serviceaccount", "default", "-n", name)
    )
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
