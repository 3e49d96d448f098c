"""The operator's reconcile timer: a pass every ``resync_s``, but every ``rollout_resync_s``
while a rollout is in progress or the spec changed, so new pods are seen Ready, the routing
switched and drained pools deleted within seconds of happening, not a resync later."""

from __future__ import annotations

from typing import Any

import pytest

from epd_operator.kube import handlers
from epd_operator.kube.settings import OperatorSettings

SETTINGS = OperatorSettings(resync_s=10.0, rollout_resync_s=2.0)


def _status(progressing: str, observed: int = 3) -> dict[str, Any]:
    return {
        "observedGeneration": observed,
        "conditions": [
            {"type": "Ready", "status": "True", "reason": "AllPoolsReady"},
            {"type": "Progressing", "status": progressing, "reason": "WaitingForPools"},
        ],
    }


def test_the_timer_ticks_at_the_shorter_interval() -> None:
    assert SETTINGS.timer_interval_s == 2.0
    assert OperatorSettings(resync_s=1.0, rollout_resync_s=2.0).timer_interval_s == 1.0


def test_a_resync_shorter_than_the_rollout_interval_wins() -> None:
    fast = OperatorSettings(resync_s=1.0, rollout_resync_s=2.0)  # e.g. the k8s tests' 1 s
    assert fast.pass_due(_status("True"), 3, 100.0, 101.0)
    assert fast.pass_due(_status("False"), 3, 100.0, 101.0)


def test_env_sets_the_rollout_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPD_OPERATOR_ROLLOUT_RESYNC_S", "0.5")
    assert OperatorSettings.from_env().rollout_resync_s == 0.5
    monkeypatch.delenv("EPD_OPERATOR_ROLLOUT_RESYNC_S")
    assert OperatorSettings.from_env().rollout_resync_s == 2.0


@pytest.mark.parametrize(
    ("status", "generation", "since_s", "due"),
    [
        (_status("False"), 3, 2.0, False),  # rollout complete: wait for the resync
        (_status("False"), 3, 10.0, True),
        (_status("True"), 3, 2.0, True),  # rolling out: every 2 s
        (_status("True"), 3, 1.0, False),
        (_status("False"), 4, 2.0, True),  # the spec changed since the last status
        ({}, 1, 2.0, True),  # no status written yet
    ],
)
def test_pass_due(status: dict[str, Any], generation: int, since_s: float, due: bool) -> None:
    assert SETTINGS.pass_due(status, generation, 100.0, 100.0 + since_s) is due
    assert SETTINGS.pass_due(status, generation, None, 0.0)  # the first pass always runs


class Patch:
    def __init__(self) -> None:
        self.status: dict[str, Any] = {}


def test_the_handler_skips_ticks_that_are_not_due(monkeypatch: pytest.MonkeyPatch) -> None:
    passes: list[float] = []
    clock = [1000.0]
    monkeypatch.setattr(handlers, "SETTINGS", SETTINGS)
    monkeypatch.setattr(handlers, "_client", lambda: None)
    monkeypatch.setattr(handlers.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(handlers, "reconcile", lambda *_, **__: passes.append(clock[0]) or {})
    monkeypatch.setattr(handlers, "_last_pass", {})

    def tick(status: dict[str, Any], after_s: float) -> None:
        clock[0] += after_s
        handlers.reconcile_timer(
            body={}, meta={"generation": 3}, spec={}, status=status, name="x",
            namespace="ns", uid="u1", patch=Patch(),
        )  # fmt: skip

    tick(_status("False"), 0.0)  # first: runs
    tick(_status("False"), 2.0)  # complete, 2 s later: skipped
    tick(_status("False"), 8.0)  # 10 s after the last pass: runs
    tick(_status("True"), 2.0)  # rolling out: runs every 2 s
    tick(_status("True"), 2.0)
    assert passes == [1000.0, 1010.0, 1012.0, 1014.0]
