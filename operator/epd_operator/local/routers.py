"""The router replicas of a reconciled local run (``router.replicas``), as processes.

One replica listens on the run's port itself. Several each get a port of their own and a
per-connection balancer takes the run's port (``epd_engine.local.tcp_balancer``), as a
Service spreads connections over router pods; instances are given every replica's URL and
the reconciler switches and reads each replica. A replica that exits is started again on
its port. The number is read once, at start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from epd_engine.config import SLO
from epd_engine.local import http_calls
from epd_engine.local.ports import free_port
from epd_engine.local.tcp_balancer import TcpBalancer

HOST = "127.0.0.1"
START_TIMEOUT_S = 60.0


class LocalRouters:
    def __init__(
        self, port: int, replicas: int, run_dir: Path, model_name: str, deployment_id: str = ""
    ) -> None:
        self.port = port
        # instances prove they belong to this run when they register (api/auth.py)
        self.deployment_id = deployment_id
        self.run_dir = run_dir
        self.model_name = model_name
        self.ports = [port] if replicas == 1 else [free_port() for _ in range(replicas)]
        self.popens: list[subprocess.Popen[bytes] | None] = [None] * replicas
        self.balancer: TcpBalancer | None = None

    @property
    def url(self) -> str:
        """What clients use: the router, or the balancer in front of the replicas."""
        return f"http://{HOST}:{self.port}"

    @property
    def urls(self) -> list[str]:
        """Each replica's own URL."""
        return [f"http://{HOST}:{port}" for port in self.ports]

    def pids(self) -> list[int]:
        return [p.pid for p in self.popens if p is not None]

    def start(self, slo: SLO, token: str) -> None:
        for replica in range(len(self.ports)):
            self._start(replica, slo, token)
        if len(self.ports) > 1 and self.balancer is None:
            self.balancer = TcpBalancer(HOST, self.port, [(HOST, p) for p in self.ports])
            self.balancer.start_in_thread()

    def restart_dead(self, slo: SLO, token: str) -> list[int]:
        """Start again each replica that exited; the replicas restarted."""
        dead = [i for i, p in enumerate(self.popens) if p is not None and p.poll() is not None]
        for replica in dead:
            self._start(replica, slo, token)
        return dead

    def _name(self, replica: int) -> str:
        return "router" if len(self.ports) == 1 else f"router-{replica}"

    def _start(self, replica: int, slo: SLO, token: str) -> None:
        name = self._name(replica)
        log = self.run_dir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        trace = "trace" if len(self.ports) == 1 else f"trace-{replica}"  # one file per writer
        args = [
            sys.executable, "-m", "epd_engine", "router",
            "--model", self.model_name,
            "--host", HOST, "--port", str(self.ports[replica]),
            "--trace-dir", str(self.run_dir / trace),
            "--slo-ttft", str(slo.ttft_s), "--slo-tpot", str(slo.tpot_s),
            "--slo-attainment", str(slo.attainment),
            "--log-level", "warning",
        ]  # fmt: skip
        with log.open("ab") as out:
            popen = subprocess.Popen(
                args,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={
                    **os.environ,
                    "EPD_INTERNAL_TOKEN": token,
                    "EPD_DEPLOYMENT_ID": self.deployment_id,
                },
                start_new_session=True,
            )
        self.popens[replica] = popen
        url = self.urls[replica]
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if popen.poll() is not None:
                raise RuntimeError(f"the router exited; see {log}")
            try:
                if http_calls.get(f"{url}/health/live", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the router did not answer in {START_TIMEOUT_S:.0f} s; see {log}")

    def stop(self) -> None:
        for popen in self.popens:
            if popen is not None and popen.poll() is None:
                os.killpg(popen.pid, signal.SIGINT)
        for popen in self.popens:
            if popen is None:
                continue
            try:
                popen.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(popen.pid, signal.SIGKILL)
                popen.wait()
        if self.balancer is not None:
            self.balancer.stop_thread()
            self.balancer = None
