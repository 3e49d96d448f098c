"""Emulated instances: the real scheduler, budgets and page accounting, with step, encode and
transfer times taken from a cost model and deterministic tokens -- no torch, no weights.

For exercising the router, the loop and the operator at fleet scale on one machine. Nothing
an emulated instance reports is evidence of the engine's speed: its times are the cost
model's, and every name it answers with says so (``EMULATED_SUFFIX``).
"""

EMULATED_SUFFIX = "-emulated"
EMULATED_NOTE = "emulated instance: times come from a cost model, not evidence of engine speed"


def emulated_name(name: str) -> str:
    """The name an emulated instance (and a router in front of only such) answers to: never
    a real model's."""
    return name if name.endswith(EMULATED_SUFFIX) else name + EMULATED_SUFFIX
