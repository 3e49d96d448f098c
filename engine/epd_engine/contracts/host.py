"""Which machine this process runs on (pure Python: the router, the emulator and the
transfer backends all need it, and only the last import torch)."""

from __future__ import annotations

import socket


def host_id() -> str:
    """Same kernel, same id (every pod and process on one machine): shared memory and
    CUDA IPC are possible only between such processes."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()
