"""CPU time of another process (Linux ``/proc``): a cost figure that, unlike wall time,
does not grow when other work shares the cores."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far (clock ticks -> seconds)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
