"""Local launcher: one EPDDeployment + plan -> router and role pools as local processes.

The same spec and plan the operator renders into Deployments become, here, processes on
127.0.0.1 (CPU, or local GPUs). State lives in ``runs/<name>/`` so ``epdctl down`` and
``epdctl status`` can find a running system.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from epd_engine.plan import Plan


@dataclass(frozen=True)
class InstanceSpec:
    name: str  # instance id, e.g. demo-p-0
    role: str
    pool: str
    port: int
    args: list[str]


@dataclass
class LaunchSpec:
    name: str
    model_name: str
    model_dir: Path
    plan: Plan
    router_port: int
    run_dir: Path
    host: str = "127.0.0.1"
    slo_ttft_s: float = 4.0
    slo_tpot_s: float = 0.08
    dtype: str = "float32"
    device: str = "cpu"
    engine_args: list[str] = field(default_factory=list)
    instance_env: dict[str, str] = field(default_factory=dict)  # e.g. EPD_* settings
    instance_timeout_s: float = 3.0  # router drops an instance after this much silence

    @property
    def router_url(self) -> str:
        return f"http://{self.host}:{self.router_port}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def pool_name(deployment: str, role: str) -> str:
    """Deterministic pool names, shared with the operator's naming (``<name>-<role>``)."""
    return f"{deployment}-{role.lower()}"


def instances(spec: LaunchSpec) -> list[InstanceSpec]:
    out = []
    for role, count in spec.plan.pools.items():
        pool = pool_name(spec.name, role.value)
        budgets = spec.plan.budgets.get(role)
        for index in range(count):
            port = free_port()
            args = [
                "serve",
                "--model", str(spec.model_dir),
                "--served-model-name", spec.model_name,
                "--role", role.value,
                "--pool", pool,
                "--instance-id", f"{pool}-{index}",
                "--host", spec.host,
                "--port", str(port),
                "--router-url", spec.router_url,
                "--dtype", spec.dtype,
                "--device", spec.device,
                "--slo-ttft", str(spec.slo_ttft_s),
                "--slo-tpot", str(spec.slo_tpot_s),
                "--log-level", "warning",
            ]  # fmt: skip
            if budgets is not None:
                args += ["--token-budget", str(budgets.token_budget)]
                args += ["--image-budget", str(budgets.image_budget)]
            out.append(
                InstanceSpec(f"{pool}-{index}", role.value, pool, port, args + spec.engine_args)
            )
    return out


def router_args(spec: LaunchSpec) -> list[str]:
    return [
        "router",
        "--model", spec.model_name,
        "--host", spec.host,
        "--port", str(spec.router_port),
        "--trace-dir", str(spec.run_dir / "trace"),
        "--slo-ttft", str(spec.slo_ttft_s),
        "--slo-tpot", str(spec.slo_tpot_s),
        "--instance-timeout", str(spec.instance_timeout_s),
        "--log-level", "warning",
    ]  # fmt: skip


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path


class LocalSystem:
    """Starts, watches and stops the processes of one launch."""

    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec
        self.processes: list[Process] = []

    def _start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Process:
        log = self.spec.run_dir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as out:
            popen = subprocess.Popen(
                [sys.executable, "-m", "epd_engine", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,  # Ctrl-C reaches `up`, which stops children in order
            )
        process = Process(name, popen, log)
        self.processes.append(process)
        return process

    def start(self) -> list[InstanceSpec]:
        self._start("router", router_args(self.spec))
        planned = instances(self.spec)
        for instance in planned:
            self._start(instance.name, instance.args, self.spec.instance_env)
        self.write_state(planned)
        return planned

    def wait_ready(self, timeout_s: float, on_progress=None) -> None:
        """Until every planned instance has registered with the router."""
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
        try:
            pools = httpx.get(f"{self.spec.router_url}/internal/pools", headers=_token(), timeout=2)
            return sum(len(p["instances"]) for p in pools.json()["pools"].values())
        except (httpx.HTTPError, ValueError, KeyError):
            return 0

    def process(self, name: str) -> Process:
        return next(p for p in self.processes if p.name == name)

    def dead(self) -> list[Process]:
        return [p for p in self.processes if p.popen.poll() is not None]

    def stop(self, timeout_s: float = 15) -> None:
        """Instances first (the router re-routes nothing: everything is going), then router."""
        for process in reversed(self.processes):
            if process.popen.poll() is None:
                os.killpg(process.popen.pid, signal.SIGINT)
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            remaining = max(0.1, deadline - time.monotonic())
            try:
                process.popen.wait(remaining)
            except subprocess.TimeoutExpired:
                os.killpg(process.popen.pid, signal.SIGKILL)
                process.popen.wait()
        state = self.spec.run_dir / "state.json"
        state.unlink(missing_ok=True)

    def write_state(self, planned: list[InstanceSpec]) -> None:
        state = {
            "name": self.spec.name,
            "pid": os.getpid(),
            "router_url": self.spec.router_url,
            "plan": self.spec.plan.model_dump(mode="json"),
            "instances": [{"name": i.name, "role": i.role, "port": i.port} for i in planned],
        }
        (self.spec.run_dir / "state.json").write_text(json.dumps(state, indent=2))


def _token() -> dict[str, str]:
    from epd_engine.config import internal_token

    return {"X-EPD-Token": internal_token()}


def read_state(run_dir: Path) -> dict[str, object] | None:
    path = run_dir / "state.json"
    if not path.exists():
        return None
    data: dict[str, object] = json.loads(path.read_text())
    return data
