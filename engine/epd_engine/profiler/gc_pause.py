"""The cyclic garbage collector paused while a simulation runs.

A fleet-sized simulation allocates millions of small objects (requests, outputs, heap
entries) and frees them in order; it makes no reference cycles worth collecting before it
ends. With the collector on, its generation scans, which walk every live object of the run
again and again, took ~15 % of a 256-GPU x 10,000-request plan search. Reference counting
still frees everything as usual; the collector runs again when the last simulation of the
process ends (simulations in several threads: a count, not a flag).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def gc_paused() -> Iterator[None]:
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
