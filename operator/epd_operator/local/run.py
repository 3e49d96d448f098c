"""``epdctl up`` with the reconcile loop: a router process, then ``LocalReconciler`` passes
until stopped, re-reading ``runs/<name>/manifest.yaml`` (``epdctl apply`` writes it).

The state file (``runs/<name>/state.json``, private to its user) carries what ``epdctl
down``, ``status`` and ``apply`` need: the supervisor's pid, every child's pid (each leads
its own process group), the router's URL and token, and the last pass's status with the
manifest generation it was made on.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

from epd_engine.config import Role
from epd_engine.contracts.gpu_placement import GpuSlots, local_gpu_slots
from epd_engine.contracts.plan import Budgets
from epd_engine.emulate import emulated_name
from epd_engine.local.state_file import remove_state, write_private, write_state
from epd_operator.api.spec import EPDDeployment, EPDDeploymentSpec, ManifestError
from epd_operator.local.pools import LocalEngines
from epd_operator.local.reconciler import (
    LocalReconciler,
    LocalStatus,
    engine_args,
    uses_tensor_parallel,
)
from epd_operator.local.routers import LocalRouters
from epd_operator.planning.cost_file import checkpoint_mismatch, cost_source
from epd_operator.rollout.loop_metrics import LoopMetrics

MANIFEST = "manifest.yaml"
_GENERATION = "# epdctl-generation: "


def manifest_generation(path: Path) -> int:
    try:
        first = path.read_text().split("\n", 1)[0]
    except OSError:
        return 0
    return int(first.removeprefix(_GENERATION)) if first.startswith(_GENERATION) else 0


def write_manifest(path: Path, text: str) -> int:
    """Store a manifest for the running loop, one generation past the stored one."""
    generation = manifest_generation(path) + 1
    write_private(path, f"{_GENERATION}{generation}\n{text}")
    return generation


@dataclass
class Options:
    name: str
    model_name: str
    model_dir: Path
    run_dir: Path
    port: int
    device: str = "cpu"
    dtype: str = "float32"
    interval_s: float = 1.0
    timeout_s: float = 300.0  # the first rollout must complete within this
    cost_model: Path | None = None  # --cost-model: what the profiler plans with (else reference)
    plan_budgets: dict[Role, Budgets] = field(default_factory=dict)  # `up --plan`: no search
    emulate: Path | None = None  # `up --emulate COST_MODEL`: every instance an emulated one

    @property
    def served_model_name(self) -> str:
        """What clients ask the router for: an emulated run's name says so."""
        return emulated_name(self.model_name) if self.emulate else self.model_name


def _log(kind: str, reason: str, message: str) -> None:
    stamp = datetime.now(UTC).strftime("%H:%M:%S")
    print(f"{stamp} {kind:<7} {reason}: {message}", file=sys.stderr, flush=True)


class LocalRun:
    def __init__(self, opts: Options, manifest_text: str) -> None:
        self.opts = opts
        self.token = os.environ.get("EPD_INTERNAL_TOKEN") or secrets.token_urlsafe(32)
        self.deployment_id = uuid.uuid4().hex  # this run's: an earlier run's engine cannot join
        self.manifest = opts.run_dir / MANIFEST
        self.manifest.unlink(missing_ok=True)
        self.generation = write_manifest(self.manifest, manifest_text)
        self.spec = self._read_manifest()
        if isinstance(self.spec, str):
            raise ValueError(self.spec)
        self.spec_error = ""
        self.mtime = self.manifest.stat().st_mtime_ns
        # router.replicas is read here, once: a balancer in front when there are several
        self.routers = LocalRouters(
            opts.port, self.spec.router.replicas, opts.run_dir, opts.served_model_name,
            self.deployment_id,
        )  # fmt: skip
        self.router_url = self.routers.url
        engines = LocalEngines(
            opts.model_dir, opts.model_name, self.router_url, opts.run_dir, self.token,
            engine_args(self.spec), opts.device, opts.dtype,
            gpu_slots=_gpu_slots(opts.device, self.spec),
            router_urls=tuple(self.routers.urls),
            deployment_id=self.deployment_id,
            plan_budgets=opts.plan_budgets,
            emulate=opts.emulate,
        )  # fmt: skip
        costs = cost_source(opts.cost_model)  # ValueError naming a bad file, before any start
        self.metrics = LoopMetrics(CollectorRegistry())
        self.metrics_server: WSGIServer | None = None
        self.reconciler = LocalReconciler(
            opts.name, engines, _log, cost_source=costs, metrics=self.metrics,
            served_model=opts.served_model_name,
        )  # fmt: skip
        self.status: LocalStatus | None = None
        self.ready = False
        self.stopping = False

    def _read_manifest(self):  # -> EPDDeploymentSpec | str (why not)
        try:
            deployment = EPDDeployment.from_yaml(self.manifest)
        except (ManifestError, OSError) as exc:
            return str(exc)
        if deployment.name != self.opts.name:
            return f"metadata.name is {deployment.name!r}, this run is {self.opts.name!r}"
        if deployment.spec.model.name != self.opts.model_name:
            return "model.name cannot change on a running deployment (restart it)"
        return deployment.spec

    def _announce_cost_model(self) -> None:
        _log("Normal", "CostModel", f"the profiler plans with {self.reconciler.cost_label}")
        model, _ = self.reconciler.cost_source()
        if self.opts.emulate is not None:
            _log("Normal", "Emulated", f"every instance is emulated, timed by {self.opts.emulate}")
        if self.opts.cost_model is not None:
            why = checkpoint_mismatch(model, self.opts.model_dir)
            if why:
                _log("Warning", "CostModelMismatch", why)
            return
        spec = self.spec
        assert not isinstance(spec, str)
        ref = spec.profiler.cost_model
        if ref is not None:
            _log(
                "Warning",
                "CostModelNotRead",
                f"profiler.costModel (ConfigMap {ref.config_map_name}) is read in a cluster "
                "only; pass `epdctl up --cost-model FILE` to plan with a measured model",
            )

    def _start_routers(self) -> None:
        spec = self.spec
        assert not isinstance(spec, str)
        self.routers.start(spec.slo.to_slo(), self.token)

    def _reload(self) -> None:
        try:
            mtime = self.manifest.stat().st_mtime_ns
        except OSError:
            return
        if mtime == self.mtime:
            return
        self.mtime = mtime
        generation = manifest_generation(self.manifest)
        spec = self._read_manifest()
        if isinstance(spec, str):
            self.spec_error = spec
            _log("Warning", "InvalidManifest", f"generation {generation} kept out: {spec}")
            return
        self.spec, self.generation, self.spec_error = spec, generation, ""
        _log("Normal", "Applied", f"manifest generation {generation}")

    def write_state(self) -> None:
        pids = self.routers.pids() + self.reconciler.pids()
        state = {
            "name": self.opts.name,
            "pid": os.getpid(),
            "reconcile": True,
            "router_url": self.router_url,
            "router_urls": self.routers.urls,  # each replica's own (the same with one)
            "metrics_url": self.metrics_url,  # the loop's own (epd_loop_*)
            "token": self.token,
            "deployment_id": self.deployment_id,
            "pids": pids,
            "instances": self.reconciler.instances(),
            "ready": self.ready,
            "observed_generation": self.generation,
            "spec_error": self.spec_error,
            "status": self.status.to_json() if self.status else None,
        }
        write_state(self.opts.run_dir, state)

    @property
    def metrics_url(self) -> str | None:
        if self.metrics_server is None:
            return None
        return f"http://127.0.0.1:{self.metrics_server.server_port}/metrics"

    def _serve_metrics(self) -> None:
        """The loop's metrics on a free loopback port (the state file names it)."""
        self.metrics_server, _ = start_http_server(0, "127.0.0.1", self.metrics.registry)

    def pass_once(self) -> LocalStatus:
        self._reload()
        spec = self.spec
        assert not isinstance(spec, str)
        for instance in self.reconciler.restart_dead():
            _log("Warning", "Restarted", f"engine {instance} exited; started again")
        for replica in self.routers.restart_dead(spec.slo.to_slo(), self.token):
            _log("Warning", "Restarted", f"router replica {replica} exited; started again")
        self.status = self.reconciler.reconcile(spec, datetime.now(UTC))
        if self.status.complete:
            self.ready = True
        self.write_state()
        return self.status

    def run(self) -> int:
        def _terminate(*_: object) -> None:
            self.stopping = True

        signal.signal(signal.SIGTERM, _terminate)
        started = time.monotonic()
        try:
            self._announce_cost_model()
            self._serve_metrics()
            self._start_routers()
            self.write_state()
            announced = False
            progress = ""
            while not self.stopping:
                status = self.pass_once()
                if self.ready and not announced:
                    announced = True
                    self._announce_ready(status)
                elif not self.ready:
                    line = f"  {status.plan}: {status.phase}"
                    if line != progress:
                        print(line, flush=True)
                        progress = line
                    if time.monotonic() - started > self.opts.timeout_s:
                        raise TimeoutError(
                            f"{status.plan} not ready after {self.opts.timeout_s:.0f}s: "
                            f"{status.phase}"
                        )
                time.sleep(self.opts.interval_s)
        except KeyboardInterrupt:
            pass
        finally:
            print("stopping...", flush=True)
            self.stop()
        return 0

    def _announce_ready(self, status: LocalStatus) -> None:
        url, run_dir = self.router_url, self.opts.run_dir
        name = self.opts.served_model_name
        print(f"ready: {status.plan}; OpenAI endpoint {url}/v1 (model {name!r})")
        print(f"       metrics {url}/metrics, trace {url}/v1/trace")
        print(f"       the loop's metrics {self.metrics_url}")
        print(f"       internal token in {run_dir / 'state.json'} (header X-EPD-Token)")
        print(f"       change it: epdctl apply -f MANIFEST (logs in {run_dir / 'logs'})")
        print("Ctrl-C stops everything.", flush=True)

    def stop(self) -> None:
        self.reconciler.stop()
        self.routers.stop()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
        remove_state(self.opts.run_dir)


def _gpu_slots(device: str, spec: EPDDeploymentSpec) -> GpuSlots | None:
    """On CUDA, GPUs for up to twice the budget's instances: during a switch the old and the
    new pools run side by side."""
    if device == "cpu":
        return None
    if uses_tensor_parallel(spec):
        raise ValueError(
            "tensor-parallel sizes above 1 (engine.roles.<role>.tensorParallelSize, "
            "disaggregation.tensorParallelSizes) run on a cluster or on --device cpu: epdctl "
            "up gives each instance one GPU slot"
        )
    return local_gpu_slots(2 * spec.gpu_budget, spec.engine.gpu_memory_fraction)
