"""Pod logs are readable: the HTTP client's per-call lines (two heartbeats a second to each
router) only at ``--log-level debug``. Defect prevented: at the default ``info`` an engine or
emulated pod's ``kubectl logs`` was two httpx lines a second and little else."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _levels(level: str) -> str:
    code = textwrap.dedent(
        f"""
        import logging
        from epd_engine.api.log_setup import setup_logging
        setup_logging({level!r})
        print(logging.getLogger("httpx").getEffectiveLevel(), logging.getLogger().level)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_http_client_calls_are_logged_only_at_debug() -> None:
    assert _levels("info") == "30 20"  # httpx at WARNING, everything else at INFO
    assert _levels("debug") == "10 10"
