"""PNG plots: attainment vs rate per method, TTFT/TPOT CDFs, per-stage latency breakdown.

Inputs are plain data (rate points, per-request results, stage means) so real runs, sweeps
from several deployments and simulator output plot the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from epd_engine.config import SLO
from epd_engine.slo.outcomes import RequestResult


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_attainment(
    curves: Mapping[str, Sequence[tuple[float, float]]],
    path: str | Path,
    *,
    target: float = 0.9,
    goodputs: Mapping[str, float] | None = None,
) -> Path:
    """SLO attainment vs request rate, one line per method/label: ``{label: [(rate, share)]}``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, points in curves.items():
        ordered = sorted(points)
        rates, shares = [r for r, _ in ordered], [100 * a for _, a in ordered]
        line = ax.plot(rates, shares, marker="o", label=label)
        if goodputs and goodputs.get(label):
            ax.axvline(goodputs[label], color=line[0].get_color(), linestyle=":", linewidth=1)
    ax.axhline(100 * target, color="grey", linestyle="--", linewidth=1, label=f"{target:.0%}")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 105)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def _cdf(ax: Any, values: Sequence[float], label: str) -> None:
    if not values:
        return
    xs = np.sort(np.asarray(values))
    ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=label)


def plot_latency_cdfs(
    runs: Mapping[str, Sequence[RequestResult]], path: str | Path, slo: SLO | None = None
) -> Path:
    """CDFs of TTFT and of per-request p90 TPOT (the SLO quantities), one line per run."""
    plt = _pyplot()
    fig, (ax_ttft, ax_tpot) = plt.subplots(1, 2, figsize=(10, 4))
    for label, results in runs.items():
        ok = [r for r in results if r.ok]
        _cdf(ax_ttft, [r.ttft_s for r in ok if r.ttft_s is not None], label)
        _cdf(ax_tpot, [r.tpot_p90_s for r in ok if r.itl_s], label)
    for ax, name, limit in (
        (ax_ttft, "TTFT (s)", slo.ttft_s if slo else None),
        (ax_tpot, "per-request p90 TPOT (s)", slo.tpot_s if slo else None),
    ):
        if limit is not None:
            ax.axvline(limit, color="grey", linestyle="--", linewidth=1, label="SLO")
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    return _save(fig, path)


def plot_stage_breakdown(stage_means: Mapping[str, Mapping[str, float]], path: str | Path) -> Path:
    """Stacked mean seconds per stage (encode, prefill, decode, migrate...), one bar per label."""
    plt = _pyplot()
    labels = list(stage_means)
    stages: list[str] = []
    for means in stage_means.values():
        stages.extend(s for s in means if s not in stages)
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(labels) + 2), 4.2))
    bottom = np.zeros(len(labels))
    for stage in stages:
        heights = np.asarray([stage_means[label].get(stage, 0.0) for label in labels])
        ax.bar(labels, heights, bottom=bottom, label=stage)
        bottom += heights
    ax.set_ylabel("mean latency per request (s)")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    fig.clf()
    _pyplot().close(fig)
    return path
