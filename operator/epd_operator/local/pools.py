"""The rollout's pools as local processes: one ``epdctl serve`` per replica on 127.0.0.1.

The local counterpart of the Kubernetes Deployments (``controller.KubePools``): the same
``rollout_driver.rollout_pass`` creates, grows and deletes pools through it. A replica is
Ready once its process is alive and the router lists it (it registered by heartbeat); a
deleted pool's processes get SIGINT (the engine finishes and exits) and SIGKILL after a grace.
A pool resized down keeps its Ready and oldest replicas; each one removed gets SIGTERM, as a
pod scaled away does, and drains (leaves routing, finishes what it holds, exits); it keeps
its GPU until it has exited, and is killed if it outlives ``leave_grace_s``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from epd_engine.config import Role
from epd_engine.contracts.gpu_placement import GpuSlots
from epd_engine.contracts.plan import Budgets
from epd_engine.contracts.serve_args import (
    SEARCHED_BUDGET_FLAGS,
    ServeCommand,
    plan_budget_flags,
    searched_budget_flags,
)
from epd_engine.local import http_calls
from epd_engine.local.ports import free_port
from epd_engine.local.spawn import ChildProcess, spawn_epdctl
from epd_operator.local import start_priority
from epd_operator.rollout.pool_identity import PoolSpec
from epd_operator.rollout.serve_settings import role_engine_args
from epd_operator.rollout.state_machine import ObservedPool


@dataclass(frozen=True)
class LocalEngines:
    """How to start one engine process (what ``epdctl up`` passes every instance)."""

    model_dir: Path
    model_name: str
    router_url: str
    run_dir: Path
    token: str
    engine_args: tuple[str, ...] = ()
    device: str = "cpu"
    dtype: str = "float32"
    host: str = "127.0.0.1"
    gpu_slots: GpuSlots | None = None  # --device cuda: which GPU each instance gets
    # each router replica's own URL (router_url: the one clients use; the same with one)
    router_urls: tuple[str, ...] = ()
    # instances prove they belong to this run when they register (api/auth.py): an engine
    # of an earlier run with the same secret cannot join this one's router
    deployment_id: str = ""
    # a plan's budgets per role (`epdctl up --plan`), given instead of a search
    plan_budgets: Mapping[Role, Budgets] = field(default_factory=dict)
    # `epdctl up --emulate COST_MODEL`: every instance is `serve --emulate` (no checkpoint)
    emulate: Path | None = None

    @property
    def replica_urls(self) -> tuple[str, ...]:
        return self.router_urls or (self.router_url,)


# what a search depends on: the role, the checkpoint, device and dtype, the flags (SLO,
# caches, tensor-parallel ranks)
BudgetKey = tuple[Role, Path, str, str, tuple[str, ...]]


def budget_key(pool: PoolSpec, e: LocalEngines) -> BudgetKey:
    flags = (*e.engine_args, *role_engine_args(pool.ranks_of(pool.role)))
    return (pool.role, e.model_dir, e.device, e.dtype, flags)


@dataclass
class _Replica:
    instance_id: str
    popen: ChildProcess
    budget_key: BudgetKey
    url: str = ""
    spawned: float = 0.0  # wall clock (epoch s) when the process was started
    ready: float | None = None  # first pass that saw it alive and registered
    startup: dict[str, float] = field(default_factory=dict)  # the engine's own phases
    lowered: bool = False  # started at a lower CPU priority (start_priority), until Ready


@dataclass(frozen=True)
class StartupTimeline:
    """One replica's start, wall clock (epoch s): when this backend started the process, the
    phases the engine reported (``epd_engine.engine.startup``), and when a pass first saw it
    Ready."""

    instance_id: str
    pool: str
    spawned: float
    phases: dict[str, float]
    ready: float | None


@dataclass(frozen=True)
class _Leaving:
    """A replica a resize removed, draining until it exits."""

    replica: _Replica
    kill_at: float  # monotonic: SIGKILL if still alive then


@dataclass
class _Pool:
    spec: PoolSpec  # as last applied: what a restarted replica starts with
    replicas: list[_Replica] = field(default_factory=list)
    leaving: list[_Leaving] = field(default_factory=list)


class LocalPools:
    def __init__(
        self, engines: LocalEngines, stop_grace_s: float = 15.0, leave_grace_s: float = 60.0
    ) -> None:
        """``leave_grace_s``: how long a replica removed by a resize may drain (the engine's
        own ``--drain-timeout`` is 30 s) before it is killed."""
        self.engines = engines
        self.stop_grace_s = stop_grace_s
        self.leave_grace_s = leave_grace_s
        self.pools: dict[str, _Pool] = {}
        # Budgets an instance searched against the SLO at start (HydraInfer), per role and
        # engine settings (model, device, flags, SLO): later instances of that role with the
        # same settings are given them and start without the search.
        self.searched_budgets: dict[BudgetKey, dict[str, int]] = {}

    # --- PoolBackend -------------------------------------------------------------------------

    def observe_pools(self) -> dict[str, ObservedPool]:
        self._reap_leaving()
        registered = self._registered()
        out = {}
        for name, pool in self.pools.items():
            ready = 0
            for rep in pool.replicas:
                if rep.popen.poll() is None and rep.instance_id in registered:
                    ready += 1
                    if rep.ready is None:
                        self._first_seen_ready(rep)
            n = len(pool.replicas)
            holding = (n + len(pool.leaving)) * pool.spec.gpus_per_instance  # leaving: till exit
            out[name] = ObservedPool(name, pool.spec.role, n, ready, holding)
        return out

    def apply_pool(self, pool: PoolSpec) -> None:
        state = self.pools.setdefault(pool.name, _Pool(pool))
        state.spec = pool
        while len(state.replicas) < pool.replicas:
            state.replicas.append(self._start(pool, _free_instance_id(pool.name, state)))
        if len(state.replicas) > pool.replicas:
            self._remove(state, len(state.replicas) - pool.replicas)

    def delete_pool(self, name: str) -> None:
        pool = self.pools.pop(name, None)
        if pool is not None:
            replicas = _all_replicas(pool)
            self._stop([r.popen for r in replicas])
            self._release([r.instance_id for r in replicas])

    # --- lifecycle ---------------------------------------------------------------------------

    def stop_all(self) -> None:
        replicas = [r for pool in self.pools.values() for r in _all_replicas(pool)]
        self._stop([r.popen for r in replicas])
        self._release([r.instance_id for r in replicas])
        self.pools.clear()

    def leaving(self) -> list[str]:
        """Replicas removed by a resize that have not exited yet."""
        self._reap_leaving()
        return [x.replica.instance_id for pool in self.pools.values() for x in pool.leaving]

    def leaving_by_pool(self) -> dict[str, int]:
        """How many replicas of each pool a resize removed that still drain (as last reaped)."""
        return {name: len(pool.leaving) for name, pool in self.pools.items() if pool.leaving}

    def _remove(self, pool: _Pool, count: int) -> None:
        """Take ``count`` replicas out of ``pool``: those not Ready first, then the newest
        (as a ReplicaSet picks pods to delete); each gets SIGTERM and drains."""
        by_keep = sorted(pool.replicas, key=lambda r: (r.ready is None, r.spawned))
        removed = by_keep[len(by_keep) - count :]
        pool.replicas = [r for r in pool.replicas if r not in removed]
        kill_at = time.monotonic() + self.leave_grace_s
        for rep in removed:
            if rep.popen.poll() is None:
                os.kill(rep.popen.pid, signal.SIGTERM)  # the leader only: it drains its ranks
            pool.leaving.append(_Leaving(rep, kill_at))

    def _reap_leaving(self) -> None:
        """Forget removed replicas that exited (their GPU is free again); kill the ones that
        outlived ``leave_grace_s``."""
        now = time.monotonic()
        for pool in self.pools.values():
            for x in list(pool.leaving):
                popen = x.replica.popen
                if popen.poll() is None and now >= x.kill_at:
                    os.killpg(popen.pid, signal.SIGKILL)
                    popen.wait()
                if popen.poll() is not None:
                    pool.leaving.remove(x)
                    self._release([x.replica.instance_id])

    def dead(self) -> list[str]:
        """Instances whose process exited on its own."""
        return [
            r.instance_id
            for pool in self.pools.values()
            for r in pool.replicas
            if r.popen.poll() is not None
        ]

    def restart_dead(self) -> list[str]:
        """Start again every replica whose process exited on its own (what a Deployment's
        ReplicaSet does); returns their instance ids."""
        restarted = []
        for pool in self.pools.values():
            for i, rep in enumerate(pool.replicas):
                if rep.popen.poll() is not None:
                    pool.replicas[i] = self._start(pool.spec, rep.instance_id)
                    restarted.append(rep.instance_id)
        return restarted

    def pids(self) -> list[int]:
        """Every replica's process, leaving ones included (each leads its process group)."""
        return [r.popen.pid for pool in self.pools.values() for r in _all_replicas(pool)]

    def timelines(self) -> list[StartupTimeline]:
        """Every current replica's start-up timeline."""
        return [
            StartupTimeline(r.instance_id, name, r.spawned, r.startup, r.ready)
            for name, pool in self.pools.items()
            for r in pool.replicas
        ]

    def _first_seen_ready(self, rep: _Replica) -> None:
        """Once per replica: back to the normal CPU priority, its start-up report kept, and
        the budgets it searched remembered for the next replica of its role."""
        rep.ready = time.time()
        if rep.lowered:
            start_priority.restore(rep.popen.pid)
        rep.startup, searched = self._startup_report(rep.url)
        if searched:
            self.searched_budgets.setdefault(rep.budget_key, searched)

    def _startup_report(self, url: str) -> tuple[dict[str, float], dict[str, int]]:
        """A Ready engine's start-up phases and the budgets it searched (``/health/ready``)."""
        try:
            body = http_calls.get(f"{url}/health/ready", timeout=5).json()
            phases = {str(k): float(v) for k, v in body.get("startup", {}).items()}
            searched = {
                str(k): int(v)
                for k, v in body.get("searched_budgets", {}).items()
                if k in SEARCHED_BUDGET_FLAGS and int(v) >= 1
            }
            return phases, searched
        except (httpx.HTTPError, ValueError, AttributeError, TypeError):
            return {}, {}

    def engine_args(self, pool: PoolSpec, instance_id: str, port: int) -> list[str]:
        """``epdctl serve`` arguments of one replica; budgets another instance of this role
        searched with the same settings are passed instead of searching again."""
        e = self.engines
        emulate = ("--emulate", str(e.emulate)) if e.emulate is not None else ()
        role_args = role_engine_args(pool.ranks_of(pool.role))
        return ServeCommand(
            # an emulated instance takes --model as a name only (a checkpoint is refused)
            model=e.model_name if e.emulate is not None else str(e.model_dir),
            served_model_name=e.model_name,
            role=pool.role,
            pool=pool.name,
            instance_id=instance_id,
            host=e.host,
            port=port,
            router=("--router-url", ",".join(e.replica_urls)),
            dtype=e.dtype,
            device=e.device,
            settings=(*emulate, "--log-level", "warning", *e.engine_args, *role_args),
            budgets=self._budget_flags(pool),
        ).argv()

    def _budget_flags(self, pool: PoolSpec) -> list[str]:
        """The plan's budgets for the pool's role, else those a replica of it with the same
        settings searched, else none (the instance searches)."""
        e = self.engines
        planned = plan_budget_flags(e.plan_budgets.get(pool.role))
        searched = self.searched_budgets.get(budget_key(pool, e), {})
        return planned or searched_budget_flags(searched)

    def instances(self) -> list[dict[str, object]]:
        """Every current replica, as the state file lists them."""
        return [
            {"name": r.instance_id, "role": pool.spec.role.value, "pool": name, "url": r.url,
             "port": int(r.url.rsplit(":", 1)[1]), "pid": r.popen.pid}
            for name, pool in self.pools.items()
            for r in pool.replicas
        ]  # fmt: skip

    def _start(self, pool: PoolSpec, instance_id: str) -> _Replica:
        e = self.engines
        port = free_port()
        args = self.engine_args(pool, instance_id, port)
        env = {**os.environ, "EPD_INTERNAL_TOKEN": e.token, "EPD_DEPLOYMENT_ID": e.deployment_id}
        if e.gpu_slots is not None:
            placement = e.gpu_slots.acquire(instance_id)
            args += placement.args()
            env |= placement.env()
        log = e.run_dir / "logs" / f"{instance_id}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        spawned = time.time()
        with log.open("ab") as out:
            popen = spawn_epdctl(args, out, env)
        replica = _Replica(
            instance_id, popen, budget_key(pool, e), f"http://{e.host}:{port}", spawned
        )
        replica.lowered = start_priority.lower(popen.pid)
        return replica

    def _release(self, instance_ids: list[str]) -> None:
        if self.engines.gpu_slots is not None:
            for instance_id in instance_ids:
                self.engines.gpu_slots.release(instance_id)

    def _stop(self, popens: list[ChildProcess]) -> None:
        for popen in popens:
            if popen.poll() is None:
                os.killpg(popen.pid, signal.SIGINT)
        for popen in popens:
            try:
                popen.wait(self.stop_grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(popen.pid, signal.SIGKILL)
                popen.wait()

    def _registered(self) -> set[str]:
        """Instances every router replica lists (any of them may route to it)."""
        listed = [self._registered_at(url) for url in self.engines.replica_urls]
        return set.intersection(*listed)

    def _registered_at(self, router_url: str) -> set[str]:
        try:
            resp = http_calls.get(
                f"{router_url}/internal/pools",
                headers={"X-EPD-Token": self.engines.token},
                timeout=2,
            )
            resp.raise_for_status()
            pools = resp.json()["pools"]
            return {i["instance_id"] for p in pools.values() for i in p["instances"]}
        except (httpx.HTTPError, ValueError, KeyError):
            return set()


def _all_replicas(pool: _Pool) -> list[_Replica]:
    return [*pool.replicas, *(x.replica for x in pool.leaving)]


def _free_instance_id(pool_name: str, pool: _Pool) -> str:
    """The lowest ``<pool>-<i>`` no replica of the pool uses, a leaving one included (its
    routers still know it by that id until it has drained)."""
    taken = {r.instance_id for r in _all_replicas(pool)}
    return next(
        f"{pool_name}-{i}" for i in range(len(taken) + 1) if f"{pool_name}-{i}" not in taken
    )
