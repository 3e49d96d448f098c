"""``epdctl``: one entry point, one module per subcommand under ``epd_engine.commands``.

Each command module exposes ``register(subparsers)`` and sets ``func`` on its parser.
Heavy imports (torch, FastAPI) happen inside the command functions, so ``epdctl plan`` stays light.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

from epd_engine import __version__, commands
from epd_engine.engine import startup


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epdctl", description="EPD disaggregated multimodal serving: engine, router, planner."
    )
    parser.add_argument("--version", action="version", version=f"epdctl {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{module_info.name}")
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    startup.mark("main")
    args = build_parser().parse_args(argv)
    try:
        result = args.func(args)
    except KeyboardInterrupt:
        return 130
    except UserError as exc:
        print(f"epdctl {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return int(result or 0)


class UserError(Exception):
    """A problem the user can fix (bad file, bad flag value): printed without a traceback."""
