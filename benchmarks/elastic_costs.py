"""The H200 cost model slowed by one factor, for the emulated fleet of ``bench_elastic``.

At H200 speed one emulated instance serves hundreds of requests a second, more than one
2-core router can send it, so the fleet's size would not matter. Every time of the model
(step, encode, transfer) is multiplied by ``factor``, and the benchmark's SLO by the same
factor: the fleet then behaves as an H200 fleet at ``1 / factor`` of the rate, in slow motion.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TIME_KEYS = ("fixed_s", "per_token_s", "per_kpair_s", "per_kcontext_s", "per_sample_s")


def _slow_link(link: dict[str, Any], factor: float) -> None:
    link["latency_s"] *= factor
    link["bytes_per_s"] /= factor


def slowed(costs: dict[str, Any], factor: float) -> dict[str, Any]:
    """``costs`` (a cost model's JSON) with every time ``factor`` times longer."""
    if factor <= 0:
        raise ValueError(f"factor must be positive, got {factor}")
    out = json.loads(json.dumps(costs))
    for part in ("encode", "language"):
        for key in TIME_KEYS:
            if key in out[part]:
                out[part][key] *= factor
    _slow_link(out["migration"], factor)
    for link in out.get("links", {}).values():
        _slow_link(link, factor)
    for key, value in out.get("overheads", {}).items():
        if key.endswith("_s"):
            out["overheads"][key] = value * factor
        elif key.endswith("_quantiles"):
            out["overheads"][key] = [v * factor for v in value]
    meta = out.setdefault("meta", {})
    meta["source"] = f"{meta.get('source', 'cost model')} (every time x{factor:g}, emulated)"
    return out


def write_slowed(source: Path, factor: float, dest: Path) -> Path:
    dest.write_text(json.dumps(slowed(json.loads(source.read_text()), factor), indent=1))
    return dest
