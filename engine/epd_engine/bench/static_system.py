"""The static system a benchmark measures: one plan's router and role pools started at once
as local processes (CPU, or local GPUs), supervised, then stopped.

Not ``epdctl up`` (that is the reconcile loop, ``epd_operator.local.run``): here no
reconcile pass, rollout or budget search sits in what ``epdctl bench-disagg`` measures, and
instance names are fixed in advance so fault-injection tests can kill a named process. The
state file in ``runs/<name>/`` lets ``epdctl down`` and ``status`` find it all the same.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from epd_engine.config import Role, internal_token, internal_token_set
from epd_engine.contracts.gpu_placement import local_gpu_slots
from epd_engine.contracts.plan import Plan
from epd_engine.contracts.serve_args import ServeCommand, plan_budget_flags, slo_flags
from epd_engine.local.ports import free_port
from epd_engine.local.spawn import ChildProcess, spawn_epdctl
from epd_engine.local.state_file import read_state, remove_state, write_state
from epd_engine.local.tcp_balancer import TcpBalancer


@dataclass(frozen=True)
class InstanceSpec:
    name: str  # instance id, e.g. demo-p-0
    role: str
    pool: str
    port: int
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)  # e.g. its GPU


@dataclass
class LaunchSpec:
    name: str
    model_name: str
    model_dir: Path
    plan: Plan
    router_port: int  # the clients' port: the router, or a balancer over its replicas
    run_dir: Path
    host: str = "127.0.0.1"
    slo_ttft_s: float = 4.0
    slo_tpot_s: float = 0.08
    slo_attainment: float = 0.9
    dtype: str = "float32"
    device: str = "cpu"
    gpu_memory_fraction: float = 0.9  # split between instances that share a GPU
    engine_args: list[str] = field(default_factory=list)
    role_args: dict[Role, list[str]] = field(default_factory=dict)  # after engine_args
    instance_env: dict[str, str] = field(default_factory=dict)  # e.g. EPD_* settings
    instance_timeout_s: float = 3.0  # router drops an instance after this much silence
    progress_timeout_s: float = 60.0  # router fails a request with no event this long
    # a fresh secret per run (or the caller's EPD_INTERNAL_TOKEN), never a default
    token: str = field(default_factory=lambda: internal_token() if internal_token_set() else "")
    # instances prove they belong to this run when they register with its router
    deployment_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # router.replicas: above one, each replica gets a port of its own and a per-connection
    # balancer takes router_port, as a Service spreads connections over router pods
    router_replicas: int = 1
    replica_ports: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.token:
            self.token = secrets.token_urlsafe(32)
        if not self.replica_ports:
            one = self.router_replicas == 1
            self.replica_ports = (
                [self.router_port] if one else [free_port() for _ in range(self.router_replicas)]
            )

    @property
    def router_url(self) -> str:
        return f"http://{self.host}:{self.router_port}"

    @property
    def router_urls(self) -> list[str]:
        """Each replica's own URL: instances register with, and stream events to, each."""
        return [f"http://{self.host}:{port}" for port in self.replica_ports]

    def auth_env(self) -> dict[str, str]:
        return {"EPD_INTERNAL_TOKEN": self.token, "EPD_DEPLOYMENT_ID": self.deployment_id}

    def headers(self) -> dict[str, str]:
        """What a client of this run's internal endpoints sends."""
        return {"X-EPD-Token": self.token}


def pool_name(deployment: str, role: str) -> str:
    """Deterministic pool names, shared with the operator's naming (``<name>-<role>``)."""
    return f"{deployment}-{role.lower()}"


def instances(spec: LaunchSpec) -> list[InstanceSpec]:
    slots = None
    if spec.device != "cpu":
        slots = local_gpu_slots(spec.plan.num_instances, spec.gpu_memory_fraction)
    out = []
    for role, count in spec.plan.pools.items():
        pool = pool_name(spec.name, role.value)
        budgets = spec.plan.budgets.get(role)
        for index in range(count):
            port = free_port()
            name = f"{pool}-{index}"
            args = ServeCommand(
                model=str(spec.model_dir),
                served_model_name=spec.model_name,
                role=role,
                pool=pool,
                instance_id=name,
                host=spec.host,
                port=port,
                router=("--router-url", ",".join(spec.router_urls)),
                dtype=spec.dtype,
                device=spec.device,
                settings=[*slo_flags(spec.slo_ttft_s, spec.slo_tpot_s), "--log-level", "warning"],
                budgets=plan_budget_flags(budgets),
                extra=[*spec.engine_args, *spec.role_args.get(role, [])],
            ).argv()
            env: dict[str, str] = {}
            if slots is not None:
                placement = slots.acquire(name)
                args += placement.args()
                env = placement.env()
            out.append(InstanceSpec(name, role.value, pool, port, args, env))
    return out


def router_args(spec: LaunchSpec, replica: int = 0) -> list[str]:
    """Replica ``replica``'s command line; each replica records its own trace."""
    trace = "trace" if spec.router_replicas == 1 else f"trace-{replica}"
    return [
        "router",
        "--model", spec.model_name,
        "--host", spec.host,
        "--port", str(spec.replica_ports[replica]),
        "--trace-dir", str(spec.run_dir / trace),
        "--slo-ttft", str(spec.slo_ttft_s),
        "--slo-tpot", str(spec.slo_tpot_s),
        "--slo-attainment", str(spec.slo_attainment),
        "--plan", str(spec.run_dir / "plan.json"),
        "--instance-timeout", str(spec.instance_timeout_s),
        "--progress-timeout", str(spec.progress_timeout_s),
        "--log-level", "warning",
    ]  # fmt: skip


class Process:
    """One supervised child: restarted with back-off when it dies, as a Deployment would."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self.args = args
        self.env = env
        self.log = log
        self.restarts = 0
        self.restart_at_s: float | None = None  # set while dead and waiting its back-off
        self.popen = self._spawn()

    def _spawn(self) -> ChildProcess:
        self.started_s = time.monotonic()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:  # appended: a crash's log survives the restart
            # in its own session (spawn_epdctl): stopped with anything it started by killpg
            return spawn_epdctl(self.args, out, {**os.environ, **self.env})

    def schedule_restart(self) -> float:
        """It died: when to start it again (seconds from now)."""
        now = time.monotonic()
        if now - self.started_s > STABLE_S:
            self.restarts = 0  # it ran well for a while: a new crash, not a crash loop
        backoff_s = min(RESTART_BACKOFF_S * 2**self.restarts, MAX_RESTART_BACKOFF_S)
        self.restart_at_s = now + backoff_s
        return backoff_s

    def restart(self) -> None:
        self.restarts += 1
        self.restart_at_s = None
        self.popen = self._spawn()


RESTART_BACKOFF_S = 0.5  # first restart after this, doubling per crash in a row
MAX_RESTART_BACKOFF_S = 30.0
STABLE_S = 60.0  # a child up this long has its back-off reset


class LocalSystem:
    """Starts, supervises and stops the processes of one launch."""

    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec
        self.processes: list[Process] = []
        self.planned: list[InstanceSpec] = []
        self.stopping = False
        self._lock = threading.Lock()  # supervisor thread vs stop()
        self.balancer: TcpBalancer | None = None  # in front of several router replicas

    def _start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Process:
        log = self.spec.run_dir / "logs" / f"{name}.log"
        process = Process(name, args, {**(env or {}), **self.spec.auth_env()}, log)
        self.processes.append(process)
        return process

    def start(self) -> list[InstanceSpec]:
        self.spec.run_dir.mkdir(parents=True, exist_ok=True)
        (self.spec.run_dir / "plan.json").write_text(self.spec.plan.model_dump_json(indent=2))
        self._start_routers()
        self.planned = instances(self.spec)
        for instance in self.planned:
            self._start(instance.name, instance.args, {**self.spec.instance_env, **instance.env})
        self.write_state()
        return self.planned

    def _start_routers(self) -> None:
        spec = self.spec
        if spec.router_replicas == 1:
            self._start("router", router_args(spec))
            return
        for replica in range(spec.router_replicas):
            self._start(f"router-{replica}", router_args(spec, replica))
        backends = [(spec.host, port) for port in spec.replica_ports]
        self.balancer = TcpBalancer(spec.host, spec.router_port, backends)
        self.balancer.start_in_thread()

    def wait_ready(self, timeout_s: float, on_progress=None) -> None:
        """Until every planned instance has registered with every router replica."""
        want = self.spec.plan.num_instances
        deadline = time.monotonic() + timeout_s
        seen = -1
        while time.monotonic() < deadline:
            for process in self.processes:
                if process.popen.poll() is not None:
                    tail = process.log.read_text(errors="replace")[-2000:]
                    raise RuntimeError(
                        f"{process.name} exited with {process.popen.returncode}; "
                        f"log {process.log}:\n{tail}"
                    )
            registered = self.registered()
            if registered != seen and on_progress is not None:
                on_progress(registered, want)
                seen = registered
            if registered >= want:
                return
            time.sleep(0.3)
        raise TimeoutError(f"only {seen}/{want} instances ready after {timeout_s:.0f}s")

    def registered(self) -> int:
        """Instances the replica that knows the fewest knows."""
        return min(self._registered_at(url) for url in self.spec.router_urls)

    def _registered_at(self, router_url: str) -> int:
        try:
            pools = httpx.get(
                f"{router_url}/internal/pools", headers=self.spec.headers(), timeout=2
            )
            return sum(len(p["instances"]) for p in pools.json()["pools"].values())
        except (httpx.HTTPError, ValueError, KeyError):
            return 0

    def process(self, name: str) -> Process:
        return next(p for p in self.processes if p.name == name)

    def dead(self) -> list[Process]:
        return [p for p in self.processes if p.popen.poll() is not None]

    def supervise(self) -> list[str]:
        """One supervision round: schedule dead children for a restart after their back-off,
        restart those whose time has come. Returns what it did, for the console."""
        news: list[str] = []
        now = time.monotonic()
        with self._lock:
            if self.stopping:
                return news
            for process in self.dead():
                if process.restart_at_s is None:
                    backoff_s = process.schedule_restart()
                    news.append(
                        f"{process.name} exited with {process.popen.returncode}; restarting in "
                        f"{backoff_s:.1f} s (log {process.log})"
                    )
                elif now >= process.restart_at_s:
                    process.restart()
                    news.append(f"{process.name} restarted (restart {process.restarts})")
                    self.write_state()
        return news

    def supervise_in_background(self, interval_s: float = 0.25, report=None) -> threading.Thread:
        def run() -> None:
            while not self.stopping:
                for line in self.supervise():
                    if report is not None:
                        report(line)
                time.sleep(interval_s)

        thread = threading.Thread(target=run, name="epd-supervisor", daemon=True)
        thread.start()
        return thread

    def stop(self, timeout_s: float = 15) -> None:
        """Instances first (the router re-routes nothing: everything is going), then router;
        a child that ignores SIGINT is killed, with its whole process group."""
        with self._lock:
            self.stopping = True
        for process in reversed(self.processes):
            if process.popen.poll() is None:
                _signal_group(process.popen.pid, signal.SIGINT)
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            remaining = max(0.1, deadline - time.monotonic())
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.popen.wait(remaining)
            # the group, even when its leader is gone: nothing it started outlives the run
            _signal_group(process.popen.pid, signal.SIGKILL)
            process.popen.wait()
        if self.balancer is not None:
            self.balancer.stop_thread()
        remove_state(self.spec.run_dir)

    def write_state(self, **extra: object) -> None:
        """``runs/<name>/state.json``: what `down` and `status` need, the token included
        (so the file is private to its user)."""
        old = read_state(self.spec.run_dir) or {}
        state = {
            "name": self.spec.name,
            "pid": os.getpid(),  # the supervisor
            "router_url": self.spec.router_url,
            "token": self.spec.token,
            "deployment_id": self.spec.deployment_id,
            "plan": self.spec.plan.model_dump(mode="json"),
            "instances": [{"name": i.name, "role": i.role, "port": i.port} for i in self.planned],
            "pids": [p.popen.pid for p in self.processes],
            "ready": old.get("ready", False),
            **extra,
        }
        write_state(self.spec.run_dir, state)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
