from __future__ import annotations

import subprocess
import sys


def test_profiler_and_its_commands_import_without_torch() -> None:
    """The operator image has no torch: only profiler/profile.py may need it (lazily)."""
    code = (
        "import sys, importlib, pkgutil, epd_engine.profiler as p\n"
        "for m in pkgutil.iter_modules(p.__path__):\n"
        "    importlib.import_module(f'epd_engine.profiler.{m.name}')\n"
        "import epd_engine.commands.plan, epd_engine.commands.simulate\n"
        "import epd_engine.commands.profile_costs\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
