"""Tests of the ``nixl`` backend skip, saying why, where NIXL is not installed (the dev extra
installs it, so CI runs them)."""

from __future__ import annotations

from typing import Any

import pytest

from epd_engine.transfer.nixl_agent import nixl_missing

NIXL_MISSING = nixl_missing()
needs_nixl = pytest.mark.skipif(
    NIXL_MISSING is not None, reason=f"NIXL is not installed: {NIXL_MISSING}"
)


def backend_param(name: str, *rest: Any) -> Any:
    """A parametrisation entry ``(*rest, name)``, skipped with the reason for nixl without NIXL
    (``rest`` empty: the name alone)."""
    values = (*rest, name) if rest else name
    return pytest.param(values, marks=needs_nixl) if name == "nixl" else values
