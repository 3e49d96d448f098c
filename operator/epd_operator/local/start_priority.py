"""Engines a local rollout starts run at a lower CPU priority until they are Ready.

On one machine (``epdctl up``) a new pool's engines import torch and load the model on the
cores the serving engines use. At equal priority that start-up takes its share of the CPU
from the requests in flight: on 2 cores, every client of ``bench-switch`` once stalled 0.4 s
while two engines started. At nice +10 the kernel's scheduler gives a serving process about
nine times the CPU weight of a starting one (CFS weights 1024 and 110), and a starting engine
still gets whatever the serving ones leave. Once Ready, every thread of the engine goes back
to the priority the others run at.

Only where that way back is allowed (going back down in nice value needs CAP_SYS_NICE or an
RLIMIT_NICE that permits it, which containers often lack): elsewhere engines start at the
normal priority, so no engine is left behind at +10.
"""

from __future__ import annotations

import logging
import os
import resource
from pathlib import Path

log = logging.getLogger(__name__)

STARTING_NICE = 10
_CAP_SYS_NICE = 23  # bit in /proc/self/status CapEff


def may_restore() -> bool:
    """Whether this process may set a child's nice value back to its own."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    if soft == resource.RLIM_INFINITY or 20 - base <= soft:  # RLIMIT_NICE allows nice 20 - soft
        return True
    return _has_cap_sys_nice()


def _has_cap_sys_nice() -> bool:
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> _CAP_SYS_NICE & 1)
    return False


def lower(pid: int) -> bool:
    """Start ``pid`` (and the threads it makes from now on) at +``STARTING_NICE``; False
    when it stays at the normal priority (no way back, or it is gone)."""
    if not may_restore():
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, pid, os.getpriority(os.PRIO_PROCESS, 0) + STARTING_NICE)
    except OSError:
        return False
    return True


def restore(pid: int) -> None:
    """Every thread of ``pid`` back at this process's priority (nice is per thread on Linux:
    the threads made while it started, the engine thread among them, carry the +10)."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        threads = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        threads = [pid]
    for tid in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, base)
        except ProcessLookupError:
            pass  # a thread that ended meanwhile
        except PermissionError:
            log.warning("cannot restore the CPU priority of engine process %d", pid)
            return
