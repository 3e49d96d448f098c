"""The router moves JSON and bytes; it must not load PyTorch (hundreds of MB and seconds of
start-up per router replica). It did, through a shared request module that imported the
instance's input processor."""

from __future__ import annotations

import subprocess
import sys


def test_the_router_app_does_not_import_torch() -> None:
    probe = "import sys, epd_engine.router.app; print('torch' in sys.modules)"
    answer = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    assert answer.stdout.strip() == "False", answer.stderr[-2000:]
