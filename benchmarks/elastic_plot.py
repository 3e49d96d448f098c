"""The three plots of ``bench_elastic``: rate and forecast, instances per role, attainment
over time; each titled as emulated. Skipped, with a note, when matplotlib is missing."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _num(x: Any) -> float:
    """A status number (a decimal string, maybe empty) as a float; NaN (not drawn) if none."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


def plot(result: dict[str, Any], stem: Path) -> dict[str, str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {"skipped": "matplotlib is not in the venv: no plots"}
    fleet = result["fleet"]
    rows, tag = fleet["timeline"], "EMULATED fleet (cost model, no engine speed)"
    t = [r["t_s"] for r in rows]
    out: dict[str, str] = {}

    def save(fig: Any, name: str) -> None:
        path = stem.parent / f"{stem.name}-{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        out[name] = path.name

    fig, ax = plt.subplots(figsize=(9, 3.6))
    ax.plot(t, [r["rate_rps"] for r in rows], label="offered rate (rps)")
    decided = [d for d in fleet["decisions"] if d["forecast_rps"]]
    ax.plot(
        [d["t_s"] for d in decided],
        [_num(d["forecast_rps"]) for d in decided],
        "o--",
        label="forecast at each re-plan",
    )
    ax.plot(
        [d["t_s"] for d in decided],
        [_num(d["rate_seen_rps"]) for d in decided],
        "x",
        label="window rate seen",
    )
    share = ax.twinx()
    share.plot(t, [r["image_share"] for r in rows], color="grey", alpha=0.5, label="image share")
    share.set_ylim(0, 1)
    share.set_ylabel("image share")
    ax.set(xlabel="s", ylabel="rps", title=f"Rate and forecast - {tag}")
    ax.legend(loc="upper left", fontsize=8)
    save(fig, "rate")

    fig, ax = plt.subplots(figsize=(9, 3.6))
    pts = fleet["passes"]
    roles = sorted({role for p in pts for role in p["held"]})
    for role in roles:
        ax.step(
            [p["t_s"] for p in pts], [p["held"].get(role, 0) for p in pts], where="post", label=role
        )
    ax.step(
        [p["t_s"] for p in pts],
        [sum(p["held"].values()) for p in pts],
        where="post",
        color="black",
        linewidth=0.8,
        label="all (GPUs held)",
    )
    for c in fleet["plan_changes"]:
        ax.axvline(
            c["decided_s"],
            color="red" if c["kind"] == "method switch" else "grey",
            linewidth=0.6,
            alpha=0.6,
        )
    ax.axhline(fleet["setup"]["max_gpus"], color="black", linestyle=":", label="maxGPUs")
    ax.set(xlabel="s", ylabel="instances", title=f"Instances per role - {tag}")
    ax.legend(loc="upper left", fontsize=8)
    save(fig, "instances")

    fig, ax = plt.subplots(figsize=(9, 3.2))
    ax.plot(t, [r["attainment"] for r in rows], label="share within SLO (per bin)")
    ax.axhline(0.95, color="red", linestyle=":", label="goal 95 %")
    ax.set_ylim(0, 1.05)
    ax.set(xlabel="s", ylabel="attainment", title=f"SLO attainment - {tag}")
    ax.legend(loc="lower left", fontsize=8)
    save(fig, "attainment")
    return out
