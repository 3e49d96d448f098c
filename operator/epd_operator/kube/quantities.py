"""Sums of Kubernetes resource quantities (a group pod asks for what its members would).

Quantities are parsed with the Kubernetes client's own parser and written back in the shortest
exact form: a whole number of the largest binary unit that divides it (``6Gi``), else whole
units (``3``), else millis (``1500m``).
"""

from __future__ import annotations

from collections.abc import Iterable
from decimal import Decimal

from kubernetes.utils import parse_quantity

_BINARY_UNITS = (
    ("Ei", 2**60),
    ("Pi", 2**50),
    ("Ti", 2**40),
    ("Gi", 2**30),
    ("Mi", 2**20),
    ("Ki", 2**10),
)


def format_quantity(value: Decimal) -> str:
    """``value`` as a quantity string (exact)."""
    if value == value.to_integral_value():
        whole = int(value)
        for suffix, size in _BINARY_UNITS:
            if whole >= size and whole % size == 0:
                return f"{whole // size}{suffix}"
        return str(whole)
    milli = value * 1000
    if milli == milli.to_integral_value():
        return f"{int(milli)}m"
    return format(value, "f")


def sum_quantities(quantities: Iterable[str]) -> str:
    """The sum of quantity strings, e.g. ``["1", "500m"]`` -> ``1500m``."""
    return format_quantity(sum((Decimal(parse_quantity(q)) for q in quantities), Decimal(0)))
