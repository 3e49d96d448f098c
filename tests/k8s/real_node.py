"""What the real-pod tests share: the real node, its images, the chart's operator as a pod,
the tiny CPU EPDDeployment placed on that node, and OpenAI traffic through the router's
ClusterIP (kube-proxy routes it from the host)."""

from __future__ import annotations

import base64
import io
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
import yaml
from PIL import Image

from tests.k8s.conftest import LOG_DIR, ROOT, Cluster, wait_until

NODE = "epd-node-0"
NODE_LABEL = "epd.serving.dev/real-node"
PLACEMENT: dict[str, Any] = {
    "nodeSelector": {NODE_LABEL: "true"},
    "tolerations": [{"key": NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}],
}
IMAGES = {"engine": "epd-engine:dev", "operator": "epd-operator:dev"}
REQUIRED = os.environ.get("EPD_REQUIRE_REAL_NODE") == "1"
RELEASE = "epd-real"
RELEASE_NAMESPACE = "epd-real-system"


def unavailable(reason: str) -> None:
    if REQUIRED:
        pytest.fail(f"EPD_REQUIRE_REAL_NODE=1 but {reason}")
    pytest.skip(reason)


def require_node_and_images(cluster: Cluster) -> None:
    """The real node is Ready and holds both images (imported from .build/images/)."""
    node = cluster.get("node", NODE)
    if node is None:
        unavailable(
            f"no real node {NODE}: tools/cluster/up.sh starts one where `tools/cluster/node.sh "
            "check` passes (root, containerd, runc, CNI plugins)"
        )
    imported = subprocess.run(
        [str(ROOT / "tools" / "cluster" / "node.sh"), "import"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert imported.returncode == 0, imported.stderr
    listed = node_ctr("images", "ls", "-q").split()
    missing = [i for i in IMAGES.values() if f"docker.io/library/{i}" not in listed]
    if missing:
        unavailable(f"images {missing} not on the node: build them with `make images`")


def node_ctr(*args: str) -> str:
    """``ctr`` on the real node's containerd (its Kubernetes namespace); the output."""
    done = subprocess.run(
        ["ctr", "--address", "/run/epd-node/containerd.sock", "-n", "k8s.io", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def install_operator(cluster: Cluster, watch_namespace: str) -> None:
    """``helm install`` the chart with its operator Deployment on the real node, watching
    ``watch_namespace`` (a Role there, nothing cluster-wide), and wait for the pod."""
    values = {
        "image": {"repository": "epd-operator", "tag": "dev", "pullPolicy": "Never"},
        "operator": {"watchNamespace": watch_namespace, "resyncSeconds": 1},
        **PLACEMENT,
    }
    path = LOG_DIR / "real-operator-values.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(values))
    cluster.run("helm", "uninstall", RELEASE, "-n", RELEASE_NAMESPACE, "--wait", check=False)
    cluster.run(
        "helm", "install", RELEASE, str(ROOT / "charts" / "epd-operator"),
        "-n", RELEASE_NAMESPACE, "--create-namespace", "-f", str(path),
        "--wait", "--timeout", "180s",
        timeout_s=240,
    )  # fmt: skip


def save_logs(cluster: Cluster, namespace: str, name: str) -> None:
    """Every container's log in ``namespace`` under .build/test-logs/ (CI artifacts)."""
    out = LOG_DIR / name
    out.mkdir(parents=True, exist_ok=True)
    for pod in cluster.items("pods", "-n", namespace):
        pod_name = pod["metadata"]["name"]
        logs = cluster.kubectl("logs", "-n", namespace, pod_name, "--all-containers", check=False)
        (out / f"{pod_name}.log").write_text(logs.stdout + logs.stderr)


def tiny_manifest(name: str, disaggregation: dict[str, Any], **engine: Any) -> dict[str, Any]:
    """examples/k8s/epd-tiny-cpu.yaml on the real node, with requests its 2 cores can hold."""
    doc = yaml.safe_load((ROOT / "examples" / "k8s" / "epd-tiny-cpu.yaml").read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["disaggregation"] = {"mode": "Fixed", **disaggregation}
    doc["spec"]["engine"].update(PLACEMENT)
    doc["spec"]["engine"]["resources"] = {"requests": {"cpu": "100m", "memory": "512Mi"}}
    doc["spec"]["engine"].update(engine)
    doc["spec"]["router"].update(PLACEMENT)
    doc["spec"]["router"]["resources"] = {"requests": {"cpu": "100m", "memory": "256Mi"}}
    return dict(doc)


def red_image_url() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 30)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def router_client(cluster: Cluster, namespace: str, name: str) -> openai.OpenAI:
    svc = cluster.get("service", f"{name}-router", "-n", namespace)
    assert svc is not None, "no router Service"
    ip, port = svc["spec"]["clusterIP"], svc["spec"]["ports"][0]["port"]
    return openai.OpenAI(
        base_url=f"http://{ip}:{port}/v1", api_key="unused", max_retries=0, timeout=60
    )


def ask(client: openai.OpenAI, with_image: bool) -> str:
    content: list[dict[str, Any]] = [{"type": "text", "text": "What is in the picture?"}]
    if with_image:
        content.append({"type": "image_url", "image_url": {"url": red_image_url()}})
    answer = client.chat.completions.create(
        model="tiny-llava",
        messages=[{"role": "user", "content": content}],  # type: ignore[misc, list-item]
        max_tokens=6,
        temperature=0,
    )
    return answer.choices[0].message.content or ""


@dataclass
class Traffic:
    """Steady OpenAI traffic from ``workers`` threads (text and image requests in turn) until
    stopped; every failure is kept with its message."""

    client: openai.OpenAI
    workers: int = 2
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _run(self, worker: int) -> None:
        n = worker
        while not self._stop.is_set():
            n += 1
            try:
                ask(self.client, with_image=n % 2 == 0)
                with self._lock:
                    self.ok += 1
            except Exception as e:  # every failure is the finding
                with self._lock:
                    self.failures.append(f"{time.strftime('%H:%M:%S')} {type(e).__name__}: {e}")
            time.sleep(0.05)

    def __enter__(self) -> Traffic:
        self._threads = [
            threading.Thread(target=self._run, args=(w,), daemon=True) for w in range(self.workers)
        ]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=90)

    def count(self) -> int:
        with self._lock:
            return self.ok


def events(cluster: Cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    return cluster.items(
        "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}"
    )


def wait_pods_gone(cluster: Cluster, namespace: str, timeout_s: float = 120) -> None:
    wait_until(
        f"no pods left in {namespace}",
        lambda: not cluster.items("pods", "-n", namespace) or None,
        timeout_s,
        every_s=1,
    )


@pytest.fixture(scope="module")
def real_namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace for one module's real pods (the chart's operator watches it alone)."""
    require_node_and_images(cluster)
    name = "real-" + request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    name = name.replace("_", "-")[:40]
    delete_namespace(cluster, name)  # left by an earlier run on a kept cluster
    cluster.kubectl("create", "namespace", name)
    install_operator(cluster, name)
    try:
        yield name
    finally:
        save_logs(cluster, name, name)
        save_logs(cluster, RELEASE_NAMESPACE, f"{name}-operator")
        # EPDDeployments first, while the operator can still take its finalizer off them.
        cluster.kubectl("delete", "epd", "--all", "-n", name, "--timeout=120s", check=False)
        cluster.run("helm", "uninstall", RELEASE, "-n", RELEASE_NAMESPACE, check=False)
        delete_namespace(cluster, name)


def delete_namespace(cluster: Cluster, name: str) -> None:
    """Delete ``name`` even when no operator is left to remove its finalizer from an
    EPDDeployment there (a run that was interrupted)."""
    listed = cluster.kubectl("get", "epd", "-n", name, "-o", "name", check=False)  # no CRD yet
    for obj in listed.stdout.split() if listed.returncode == 0 else []:
        cluster.kubectl(
            "patch", obj, "-n", name,
            "--type", "merge", "-p", '{"metadata": {"finalizers": null}}',
            check=False,
        )  # fmt: skip
    cluster.kubectl("delete", "namespace", name, "--ignore-not-found", "--wait=false")
    # pods of a node that was lost and came back can take minutes to terminate on a loaded
    # host (past kubectl's 120 s here once, after test_real_node_lost)
    deadline = time.monotonic() + 300
    while cluster.get("namespace", name) is not None:
        if time.monotonic() > deadline:
            raise AssertionError(f"namespace {name} still terminating after 300 s")
        time.sleep(1.0)
