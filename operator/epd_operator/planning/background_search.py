"""The slow path's re-plan, run beside the reconcile passes instead of inside one.

Why: a re-plan replays the trace window through the profiler, which took 39-151 s for a
16-GPU fleet on this host (``make bench-elastic``). Run inside a pass, it held the pass: no
rollout step and no fast-path step (one more instance on an SLO alarm, within a scrape
window) could happen meanwhile, which is when the load is changing. Now a pass that finds a
re-plan due starts it here and goes on with the current plan (the fast path may act); a
later pass takes its result.

A result is taken only for the plan it was computed against: when the plan changed
meanwhile (the fast path scaled up, or a spec change), its comparison with the current plan
no longer holds and a fresh search starts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

_R = TypeVar("_R")


class BackgroundSearch(Generic[_R]):
    """At most one search at a time, for one deployment; each for a given plan revision."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._revision: int | None = None  # what the running or finished search is for
        self._thread: threading.Thread | None = None
        self._outcome: tuple[_R | None, BaseException | None] | None = None  # once finished

    @property
    def running(self) -> bool:
        with self._lock:
            return self._thread is not None and self._outcome is None

    @property
    def finished(self) -> bool:
        """A search ended and waits for a pass to take it."""
        with self._lock:
            return self._outcome is not None

    def take(self, revision: int | None) -> _R | None:
        """The finished search for ``revision``, once (None: none finished for it). A search
        finished for another revision is dropped; a failure is raised here, in the pass."""
        with self._lock:
            if self._outcome is None:
                return None
            result, error = self._outcome
            for_revision = self._revision
            self._outcome, self._thread, self._revision = None, None, None
        if error is not None:
            raise error
        return result if for_revision == revision else None

    def start(self, revision: int | None, search: Callable[[], _R]) -> bool:
        """Start ``search`` for ``revision`` unless one is running (False then). A search for
        another revision keeps running; its result will be dropped."""
        with self._lock:
            if self._thread is not None:
                return False
            self._revision, self._outcome = revision, None
            # a daemon thread: `epdctl down` or the operator's exit does not wait for a search
            self._thread = threading.Thread(
                target=self._run, args=(search,), name="replan", daemon=True
            )
            self._thread.start()
            return True

    def wait(self, timeout_s: float) -> bool:
        """Until the running search finishes (tests; the loop never waits). True: finished."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        return not self.running

    def _run(self, search: Callable[[], _R]) -> None:
        outcome: tuple[_R | None, BaseException | None]
        try:
            outcome = (search(), None)
        except BaseException as exc:  # re-raised in the pass that takes it
            outcome = (None, exc)
        with self._lock:
            self._outcome = outcome
