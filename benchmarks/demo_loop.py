"""``make demo-loop``: the loop closes on its own. ``epdctl up`` runs a ``mode: Auto``
manifest of the tiny model (local reconcile loop); clients send a text-heavy workload, then
an image-heavy one; the system re-plans and switches by itself. Writes the JSON behind it
and a PNG timeline (request rate, SLO attainment, the plan served, switch markers).

Client-side measures: every request streams; TTFT is the first content chunk, TPOT the mean
gap after it ((e2e - TTFT) / (tokens - 1)); a request meets the SLO when both are within the
manifest's. Switches come from the loop's state file, polled every second: "decided" when the
plan changes, "serving" when that plan's rollout completes.

``--cost-model FILE`` (``make demo-loop COST_MODEL=FILE``) has the loop plan with a cost model
from ``epdctl profile-costs`` instead of the built-in reference (``epdctl up --cost-model``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from benchmarks.switch_drill import MAX_TOKENS, _data_url, ask
from epd_engine.bench.results_file import write_results
from epd_engine.local.state_file import read_state

NAME = "demo-loop"
SLO_TTFT_S = 4.0
SLO_TPOT_S = 0.25  # a CPU on two shared cores, not a GPU


def manifest(budget: int) -> dict[str, Any]:
    return {
        "apiVersion": "epd.serving.dev/v1alpha1",
        "kind": "EPDDeployment",
        "metadata": {"name": NAME},
        "spec": {
            "model": {"name": "tiny-llava", "source": {"preset": "tiny-llava"}},
            "gpuBudget": budget,
            "slo": {
                "ttftMilliseconds": int(SLO_TTFT_S * 1000),
                "tpotMilliseconds": int(SLO_TPOT_S * 1000),
            },
            "disaggregation": {"mode": "Auto"},
            "profiler": {
                "intervalSeconds": 30,
                "traceWindowSeconds": 60,
                "minRequests": 30,
                "shiftThresholdPercent": 20,
                "cooldownSeconds": 30,
            },
            "engine": {
                "gpusPerInstance": 0,
                "numKvBlocks": 256,
                "numImageBlocks": 16,
                "extraArgs": ["--token-budget", "256", "--image-budget", "4"],
            },
        },
    }


@dataclass
class Sample:
    phase: str
    kind: str  # text | image
    start_s: float  # since the traffic started
    end_s: float
    ttft_s: float | None
    tpot_s: float | None
    met: bool
    error: str


@dataclass
class PlanPoint:
    t_s: float
    plan: str
    phase: str
    revision: int
    reason: str
    planned: str = ""  # the loop's last decision: Planned reason and message


def _messages(kind: str, rng: random.Random) -> list[dict[str, Any]]:
    words = " ".join(rng.choice(["cat", "sky", "river", "stone", "map"]) for _ in range(12))
    if kind == "text":
        return [{"role": "user", "content": f"Tell me a story about {words}."}]
    seed = rng.randrange(64)  # distinct images, so the encoder has work
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": _data_url(seed)}},
                {"type": "text", "text": f"Describe this picture. {words}"},
            ],
        }
    ]


class Workload:
    """``clients`` threads; each request is text with the phase's probability."""

    def __init__(self, url: str, clients: int, t0: float) -> None:
        self.url, self.clients, self.t0 = url, clients, t0
        self.phase, self.text_share = "", 1.0
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            phase, share = self.phase, self.text_share
            kind = "text" if rng.random() < share else "image"
            a = ask(self.url, _messages(kind, rng), stream=True)
            tpot = None
            if a.ttft_s is not None and MAX_TOKENS > 1:
                tpot = (a.end_s - a.start_s - a.ttft_s) / (MAX_TOKENS - 1)
            met = (
                not a.error
                and a.ttft_s is not None
                and a.ttft_s <= SLO_TTFT_S
                and (tpot is None or tpot <= SLO_TPOT_S)
            )
            sample = Sample(
                phase, kind, a.start_s - self.t0, a.end_s - self.t0, a.ttft_s, tpot, met, a.error
            )
            with self._lock:
                self.samples.append(sample)

    def start(self) -> None:
        for c in range(self.clients):
            t = threading.Thread(target=self._run, args=(c,), daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> int:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=180)
        return sum(t.is_alive() for t in self._threads)


class PlanWatcher:
    def __init__(self, run_dir: Path, t0: float) -> None:
        self.run_dir, self.t0 = run_dir, t0
        self.points: list[PlanPoint] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            state = read_state(self.run_dir) or {}
            status = state.get("status") or {}
            if status:
                point = PlanPoint(
                    time.monotonic() - self.t0,
                    status["plan"],
                    status["phase"],
                    status["revision"],
                    status["reason"],
                    ": ".join(status["conditions"].get("Planned", ["", "", ""])[1:]),
                )
                last = self.points[-1] if self.points else None
                seen = (point.plan, point.phase, point.planned)
                if last is None or (last.plan, last.phase, last.planned) != seen:
                    self.points.append(point)
            self._stop.wait(1.0)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def switches(points: list[PlanPoint]) -> list[dict[str, Any]]:
    """Each plan change: when the loop decided it and when its rollout completed."""
    out: list[dict[str, Any]] = []
    for prev, point in itertools.pairwise(points):
        if point.revision != prev.revision:
            out.append(
                {
                    "from": prev.plan,
                    "to": point.plan,
                    "reason": point.reason,
                    "decided_s": round(point.t_s, 1),
                    "serving_s": None,
                    "complete_s": None,
                }
            )
        last = out[-1] if out else None
        if last is None or point.plan != last["to"]:
            continue
        # Draining: every router replica confirmed the new plan's routing (it serves)
        if last["serving_s"] is None and point.phase in ("Draining", "RolloutComplete"):
            last["serving_s"] = round(point.t_s, 1)
        if last["complete_s"] is None and point.phase == "RolloutComplete":
            last["complete_s"] = round(point.t_s, 1)
    return out


def decisions(points: list[PlanPoint]) -> list[dict[str, Any]]:
    """Every decision of the loop (Planned: Replanned, PlanConfirmed, KeptCurrentPlan...)."""
    out: list[dict[str, Any]] = []
    for point in points:
        if point.planned and (not out or out[-1]["planned"] != point.planned):
            out.append({"t_s": round(point.t_s, 1), "planned": point.planned})
    return out


def timeline(samples: list[Sample], points: list[PlanPoint], bin_s: float) -> list[dict]:
    if not samples:
        return []
    end = max(s.end_s for s in samples)
    rows = []
    t = 0.0
    while t < end:
        done = [s for s in samples if t <= s.end_s < t + bin_s]
        plan = next((p.plan for p in reversed(points) if p.t_s <= t + bin_s), "")
        rows.append(
            {
                "t_s": t,
                "rate_rps": len(done) / bin_s,
                "text_rps": sum(s.kind == "text" for s in done) / bin_s,
                "image_rps": sum(s.kind == "image" for s in done) / bin_s,
                "attainment": (sum(s.met for s in done) / len(done)) if done else None,
                "failed": sum(bool(s.error) for s in done),
                "plan": plan,
            }
        )
        t += bin_s
    return rows


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["timeline"]
    t = [r["t_s"] for r in rows]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(11, 7.5), sharex=True)
    ax1.stackplot(t, [r["text_rps"] for r in rows], [r["image_rps"] for r in rows],
                  labels=["text", "image"], step="post", alpha=0.8)  # fmt: skip
    ax1.set_ylabel("finished req/s")
    ax1.legend(loc="upper left")
    att = [r["attainment"] if r["attainment"] is not None else float("nan") for r in rows]
    ax2.step(t, att, where="post", color="tab:green")
    ax2.axhline(result["slo"]["attainment"], color="grey", linestyle="--", label="target")
    ax2.set_ylim(-0.05, 1.05)
    ax2.set_ylabel("SLO attainment")
    ax2.legend(loc="lower left")
    plans = sorted({p["plan"] for p in result["plans"]})
    ys = [plans.index(p["plan"]) for p in result["plans"]]
    ts = [p["t_s"] for p in result["plans"]]
    ax3.step([*ts, t[-1] if t else 0], [*ys, *ys[-1:]], where="post", color="tab:purple")
    ax3.set_yticks(range(len(plans)), plans)
    ax3.set_ylabel("plan decided")
    for d in result.get("decisions", []):
        level = next((y for x, y in zip(ts[::-1], ys[::-1], strict=True) if x <= d["t_s"]), 0)
        ax3.plot(d["t_s"], level, marker="|", color="tab:gray", markersize=14)
    ax3.set_xlabel("seconds since the traffic started")
    for ax in (ax1, ax2, ax3):
        for p in result["phases"][1:]:
            ax.axvline(p["start_s"], color="black", linewidth=0.8)
        for s in result["switches"]:
            ax.axvline(s["decided_s"], color="tab:red", linestyle="--", linewidth=1)
            if s["serving_s"] is not None:
                ax.axvline(s["serving_s"], color="tab:red", linewidth=1)
    fig.suptitle(
        f"epdctl up, mode: Auto (tiny model, CPU): {result['requests']} requests, "
        f"{result['failed']} failed, {len(result['switches'])} switches; "
        f"cost model: {result.get('cost_model', 'reference')}"
        "\n(red dashed: decided, red: new plan serving; black: workload shift; grey ticks: "
        "re-plans)"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def up_args(
    file: Path, model_dir: Path, runs: Path, port: int, cost_model: Path | None = None
) -> list[str]:
    """``epdctl up``'s arguments for the demo (detached; the loop plans with ``cost_model``,
    else the built-in reference)."""
    args = ["up", "-f", str(file), "--model-dir", str(model_dir), "--runs-dir", str(runs),
            "--port", str(port), "--detach", "--timeout", "600"]  # fmt: skip
    return args if cost_model is None else [*args, "--cost-model", str(cost_model)]


def run_demo(
    model_dir: Path,
    work: Path,
    phases: list[tuple[str, float, float]],
    clients: int,
    port: int,
    cost_model: Path | None = None,
) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    file = work / f"{NAME}.yaml"
    file.write_text(yaml.safe_dump(manifest(budget=3)))
    runs = work / "runs"
    epdctl = [sys.executable, "-m", "epd_engine"]
    up = subprocess.run(
        [*epdctl, *up_args(file, model_dir, runs, port, cost_model)],
        capture_output=True,
        text=True,
        timeout=700,
    )
    if up.returncode != 0:
        raise RuntimeError(f"epdctl up failed:\n{up.stdout}{up.stderr}")
    try:
        state = read_state(runs / NAME)
        assert state is not None
        t0 = time.monotonic()
        cost_label = (state.get("status") or {}).get("cost_model", "")
        watcher = PlanWatcher(runs / NAME, t0)
        watcher.start()
        load = Workload(state["router_url"], clients, t0)
        phase_rows = []
        for name, text_share, seconds in phases:
            load.phase, load.text_share = name, text_share
            phase_rows.append({"name": name, "text_share": text_share,
                               "start_s": round(time.monotonic() - t0, 1)})  # fmt: skip
            if len(phase_rows) == 1:
                load.start()
            time.sleep(seconds)
        hung = load.stop()
        time.sleep(2)
        watcher.stop()
    finally:
        subprocess.run([*epdctl, "down", NAME, "--runs-dir", str(runs)], timeout=120)
    samples = load.samples
    return {
        "manifest": manifest(budget=3),
        "slo": {"ttft_s": SLO_TTFT_S, "tpot_s": SLO_TPOT_S, "attainment": 0.9},
        "cost_model": cost_label or (str(cost_model) if cost_model else "reference"),
        "phases": phase_rows,
        "clients": clients,
        "requests": len(samples),
        "failed": sum(bool(s.error) for s in samples),
        "hung_clients": hung,
        "failures": sorted({s.error for s in samples if s.error})[:10],
        "switches": switches(watcher.points),
        "decisions": decisions(watcher.points),
        "plans": [asdict(p) for p in watcher.points],
        "timeline": timeline(samples, watcher.points, bin_s=5.0),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="tiny checkpoint directory")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/demo-loop.json"))
    p.add_argument("--png", type=Path, default=Path("benchmarks/results/demo-loop.png"))
    p.add_argument("--work", type=Path, default=Path("runs/demo-loop-work"))
    p.add_argument("--phase-seconds", type=float, default=150)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--port", type=int, default=8090)
    p.add_argument(
        "--cost-model",
        type=Path,
        help="cost model JSON (`epdctl profile-costs`) the loop plans with; default: reference",
    )
    args = p.parse_args(argv)
    phases = [("text-heavy", 0.9, args.phase_seconds), ("image-heavy", 0.1, args.phase_seconds)]
    result = run_demo(args.model, args.work, phases, args.clients, args.port, args.cost_model)
    write_results(args.out, result)
    plot(result, args.png)
    shown = ("cost_model", "requests", "failed", "switches")
    print(json.dumps({k: result[k] for k in shown}, indent=2))
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
