"""One NIXL agent per instance, with the caches registered once (the ``nixl`` backend's engine).

NIXL comes from PyPI as ``nixl-cu13`` (the CUDA of the locked torch; ``nixl-cu12`` and the
``nixl`` meta package are taken too). Its Python wrapper starts the UCX progress thread with
no delay between polls, a busy loop that keeps a core at 100% even when idle; the agent here
gets a 1 ms poll timeout instead (the thread still wakes at once on the worker's event fd:
2% of a core idle, measured). Calls come from several worker threads: the agent locks
itself (``NIXL_THREAD_SYNC_STRICT``).

A read that outlives its deadline cannot be cancelled: releasing its handle and removing
the peer leave UCX writing into our pages once a stalled source resumes (seen over UCX's
tcp transport). Only destroying the agent stops it, so such an agent is **retired**: new
pulls use a fresh agent, and the old one is destroyed once its last in-flight read ends.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from importlib import import_module
from types import ModuleType
from typing import Any

import numpy as np
import torch

from epd_engine.transfer.backend import TransferError

log = logging.getLogger(__name__)
PROGRESS_POLL_US = 1000  # the progress thread's poll timeout (0 in NIXL's wrapper: a spin)
POLL_S = (0.00002, 0.001)  # first and longest sleep between a read's state checks
API_MODULES = ("nixl_cu13._api", "nixl_cu12._api", "nixl._api")


def nixl_api() -> ModuleType:
    """NIXL's Python API; ``RuntimeError`` saying what to install when it is missing."""
    cuda = torch.version.cuda
    preferred = [f"nixl_cu{cuda.split('.')[0]}._api"] if cuda else []
    failures = []
    for name in dict.fromkeys([*preferred, *API_MODULES]):
        try:
            return import_module(name)
        except ImportError as exc:
            failures.append(f"{name}: {exc}")
    raise RuntimeError(
        "the nixl backend needs NIXL: pip install 'epd-operator[nixl]' (nixl-cu13); "
        + "; ".join(failures)
    )


def nixl_missing() -> str | None:
    """Why the nixl backend cannot run here, or None."""
    try:
        nixl_api()
    except RuntimeError as exc:
        return str(exc)
    return None


def nixl_errors(api: ModuleType) -> tuple[type[BaseException], ...]:
    """The exceptions NIXL's bindings raise (each derives from Exception directly)."""
    bind = api.nixlBind
    found = [getattr(bind, n) for n in dir(bind) if n.startswith("nixl") and n.endswith("Error")]
    return (RuntimeError, ValueError, TypeError, *found)


def memory_type(tensor: torch.Tensor) -> str:
    return "VRAM" if tensor.is_cuda else "DRAM"


class Agent:
    """A NIXL agent over this instance's cache tensors, and the remote agents it has loaded
    (one per peer instance). ``use()``/``done()`` bracket every read so ``retire`` can wait."""

    def __init__(self, api: ModuleType, tensors: Sequence[torch.Tensor]) -> None:
        self.api = api
        self.errors = nixl_errors(api)
        self.name = f"epd-{uuid.uuid4().hex}"
        self.mem_type = memory_type(tensors[0])
        try:
            self._agent = self._start_agent()
            self._registered = self._agent.register_memory(list(tensors))
            self.metadata: bytes = self._agent.get_agent_metadata()
        except self.errors as exc:
            raise TransferError(f"cannot start a NIXL agent: {exc!r}") from exc
        self._remotes: dict[str, str] = {}  # peer instance id -> remote agent name
        self._lock = threading.Lock()
        self._users = 0
        self._retired = False

    def _start_agent(self) -> Any:
        api = self.api
        agent = api.nixl_agent(self.name, api.nixl_agent_config(backends=[]))
        config = api.nixlBind.nixlAgentConfig()
        config.useProgThread = True
        config.useListenThread = False  # metadata travels in our offers, not NIXL's listener
        config.syncMode = api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT.value
        config.pthrDelay = PROGRESS_POLL_US
        config.lthrDelay = 100_000
        config.captureTelemetry = False
        # The wrapper takes no progress delay: swap in a core agent made with one, before any
        # backend exists (a backend reads the delay when it starts its thread).
        agent.agent = api.nixlBind.nixlAgent(self.name, config)
        # Peer error handling (the plugin's default, said here): a peer that dies mid-read
        # fails that read, not this process (seen: a target killed mid-read, source alive).
        # EPD_NIXL_UCX_ERROR_MODE=none turns it off: on the H200, with UCX_CUDA_IPC_ENABLE_
        # GET_ZCOPY=on as well, a pull between two processes of one GPU went from 0.8 to 130
        # GB/s (docs/gpu.md); off alone it did not help.
        mode = os.environ.get("EPD_NIXL_UCX_ERROR_MODE", "peer")
        agent.create_backend("UCX", {"ucx_error_handling_mode": mode})
        return agent

    # ---- peers --------------------------------------------------------------------------
    def remote(self, instance_id: str, agent_name: str, metadata: bytes) -> str:
        """The peer's agent, loaded once (again when the peer started a new agent)."""
        with self._lock:
            loaded = self._remotes.get(instance_id)
            if loaded == agent_name:
                return loaded
            try:
                if loaded is not None:
                    self._agent.remove_remote_agent(loaded)
                    del self._remotes[instance_id]
                name: str = self._agent.add_remote_agent(metadata)
            except self.errors as exc:
                raise TransferError(f"cannot load {instance_id}'s NIXL agent: {exc!r}") from exc
            if isinstance(name, bytes):
                name = name.decode()
            if name != agent_name:
                raise TransferError(f"{instance_id}'s metadata is agent {name}, not {agent_name}")
            self._remotes[instance_id] = name
            return name

    def forget(self, instance_id: str) -> None:
        with self._lock:
            name = self._remotes.pop(instance_id, None)
            if name is not None and not self._retired:
                try:
                    self._agent.remove_remote_agent(name)
                except self.errors as exc:
                    log.debug("removing %s's agent: %r", instance_id, exc)

    # ---- reads --------------------------------------------------------------------------
    def use(self) -> bool:
        """Count one more read in flight; False once retired (take the current agent)."""
        with self._lock:
            if self._retired:
                return False
            self._users += 1
            return True

    def done(self) -> None:
        with self._lock:
            self._users -= 1
            destroy = self._retired and self._users == 0
        if destroy:
            self._destroy()

    def read(
        self, remote: str, local_rows: np.ndarray, remote_rows: np.ndarray, timeout_s: float
    ) -> bool:
        """READ remote ``[addr, len, dev]`` rows into local ones; ``TransferError`` on an error,
        False when the deadline passed with the read still running (then retire this agent)."""
        agent = self._agent
        try:
            local = agent.get_xfer_descs(local_rows, self.mem_type)
            theirs = agent.get_xfer_descs(remote_rows, self.mem_type)
            handle = agent.initialize_xfer("READ", local, theirs, remote)
            state = agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            sleep_s = POLL_S[0]
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(sleep_s)
                sleep_s = min(2 * sleep_s, POLL_S[1])
                state = agent.check_xfer_state(handle)
        except self.errors as exc:
            raise TransferError(f"NIXL read from {remote} failed: {exc!r}") from exc
        if state == "PROC":
            return False  # the handle goes with the agent (releasing it would not stop UCX)
        try:
            handle.release()
        except self.errors as exc:
            log.debug("releasing a finished read: %r", exc)
        if state != "DONE":
            raise TransferError(f"NIXL read from {remote} ended in state {state}")
        return True

    # ---- lifetime -----------------------------------------------------------------------
    def retire(self) -> None:
        """Stop taking reads; destroyed as soon as none is in flight."""
        with self._lock:
            self._retired = True
            destroy = self._users == 0
        if destroy:
            self._destroy()

    def _destroy(self) -> None:
        # Dropping the core agent closes its UCX workers: no late byte reaches our pages.
        # (Its destructor deregisters the caches; the handle of a read that timed out was
        # dropped with that read, so nothing else holds the core agent.)
        agent, self._agent = self._agent, None
        if agent is not None:
            agent.agent = None
        log.info("NIXL agent %s destroyed", self.name)
