"""Switch under load: steady mixed traffic through a real router and real engine processes
while the rollout state machine moves the system through a sequence of plans.

Used by the switch-under-load test and by ``make bench-switch``. Pools are local processes
(``local_pools.LocalPools``), driven by the same ``rollout_driver.rollout_pass`` as the
operator. Traffic: text and image requests, streaming and not, greedy (temperature 0, fixed
length), from a few concurrent clients using the ``openai`` client. Every answer is compared
with the answer the first plan gave to the same prompt before any switch.

``python -m benchmarks.switch_drill --model DIR --out FILE.json`` runs the benchmark.
"""

from __future__ import annotations

import argparse
import base64
import io
import itertools
import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import openai
from PIL import Image

from epd_engine.bench.results_file import write_results
from epd_engine.config import Method, Role
from epd_engine.contracts.plan import Plan
from epd_operator.api.spec import EPDDeploymentSpec
from epd_operator.local.pools import LocalEngines, LocalPools, StartupTimeline
from epd_operator.rollout.driver import RolloutState, rollout_pass
from epd_operator.rollout.pool_identity import Owner, pool_specs
from epd_operator.rollout.router_fleet import RouterFleet

MODEL_NAME = "tiny-llava"
MAX_TOKENS = 8
# every method, then a ratio change (DESIGN: the closed loop's moves)
SEQUENCE = [
    Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 1, Role.D: 1}),
    Plan(method=Method.EP_D, pools={Role.EP: 1, Role.D: 1}),
    Plan(method=Method.EPD, pools={Role.EPD: 1}),
    Plan(method=Method.E_PD, pools={Role.E: 1, Role.PD: 1}),
    Plan(method=Method.ED_P, pools={Role.ED: 1, Role.P: 1}),
    Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 1, Role.D: 1}),
    Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 2, Role.D: 1}),
]
ENGINE_ARGS = (
    "--num-kv-blocks", "256", "--num-image-blocks", "16", "--max-num-running", "16",
    "--token-budget", "256", "--image-budget", "4",
)  # fmt: skip


def _data_url(seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 255, (48, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def prompts() -> list[list[dict[str, Any]]]:
    """Three text-only and three image prompts (one with two images)."""
    text = [
        [{"role": "user", "content": f"Tell me about request {i} and the weather."}]
        for i in range(3)
    ]
    images = [
        [
            {
                "role": "user",
                "content": [
                    *({"type": "image_url", "image_url": {"url": _data_url(s)}} for s in seeds),
                    {"type": "text", "text": "What is in this picture?"},
                ],
            }
        ]
        for seeds in ((1,), (2,), (3, 4))
    ]
    return text + images


@dataclass
class Answer:
    prompt: int
    stream: bool
    start_s: float  # monotonic
    end_s: float
    ttft_s: float | None
    text: str = ""
    error: str = ""


def ask(url: str, messages: list[dict[str, Any]], stream: bool, timeout_s: float = 120) -> Answer:
    # Closed on return: an unclosed client keeps its connection open until the garbage
    # collector finds it, and the soak then counts those idle connections against the router.
    with openai.OpenAI(
        base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout_s
    ) as client:
        return _ask(client, messages, stream)


def _ask(client: openai.OpenAI, messages: list[dict[str, Any]], stream: bool) -> Answer:
    start = time.monotonic()
    common: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    try:
        if not stream:
            resp = client.chat.completions.create(**common)
            text = str(resp.choices[0].message.content)
            return Answer(-1, False, start, time.monotonic(), None, text)
        ttft, parts = None, []
        for chunk in client.chat.completions.create(**common, stream=True):
            delta = chunk.choices[0].delta.content if chunk.choices else None
            if delta:
                ttft = ttft if ttft is not None else time.monotonic() - start
                parts.append(delta)
        return Answer(-1, True, start, time.monotonic(), ttft, "".join(parts))
    except openai.OpenAIError as exc:
        return Answer(
            -1, stream, start, time.monotonic(), None, error=f"{type(exc).__name__}: {exc}"
        )


class Traffic:
    """``clients`` threads, each cycling through the prompts (alternating stream/not)."""

    def __init__(self, url: str, clients: int = 3) -> None:
        self.url = url
        self.clients = clients
        self.answers: list[Answer] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.hung = 0  # clients still waiting on an answer at the end

    def _run(self, offset: int) -> None:
        messages = prompts()
        i = offset
        while not self._stop.is_set():
            index = i % len(messages)
            answer = ask(self.url, messages[index], stream=(i // len(messages)) % 2 == 0)
            answer.prompt = index
            with self._lock:
                self.answers.append(answer)
            i += 1

    def __enter__(self) -> Traffic:
        for c in range(self.clients):
            t = threading.Thread(target=self._run, args=(c * 2,), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=180)
        self.hung = sum(t.is_alive() for t in self._threads)


@dataclass
class Switch:
    before: str
    after: str
    decided_s: float  # monotonic
    serving_s: float | None = None  # every router replica confirmed the new plan's routing
    complete_s: float | None = None  # old pools deleted
    progress: list[str] = field(default_factory=list)
    progress_at_s: list[float] = field(default_factory=list)  # each reason's start, from decision
    decided_wall: float = field(default_factory=time.time)  # epoch s, to match engine phases
    started: list[StartupTimeline] = field(default_factory=list)  # replicas the switch started
    load_avg: tuple[float, float, float] = field(default_factory=os.getloadavg)  # at decision


def owner_for(budget: int) -> Owner:
    spec = EPDDeploymentSpec.model_validate(
        {
            "model": {"name": MODEL_NAME, "source": {"preset": "tiny-llava"}},
            "gpuBudget": budget,
            "disaggregation": {"mode": "Fixed", "method": "EPD", "pools": {"EPD": 1}},
        }
    )
    return Owner(name="drill", namespace="local", uid="local", spec=spec)


def converge(
    pools: LocalPools,
    fleet: RouterFleet,
    plan: Plan,
    state: RolloutState,
    budget: int,
    switch: Switch | None,
    timeout_s: float,
    interval_s: float = 0.3,
    on_event: Callable[[str, str, str], None] | None = None,
) -> RolloutState:
    """Rollout passes until the plan is complete; fills ``switch``'s times."""
    desired = pool_specs(owner_for(budget), plan)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if dead := pools.dead():
            raise RuntimeError(f"engine process(es) exited: {dead}")
        outcome = rollout_pass(
            pools, fleet, desired, plan, state, datetime.now(UTC), budget, 120,
            on_event or (lambda *_: None), settle_s=1.5,
        )  # fmt: skip
        state = outcome.state
        reason = outcome.status.conditions["Progressing"].reason
        if switch is not None:
            if not switch.progress or switch.progress[-1] != reason:
                switch.progress.append(reason)
                switch.progress_at_s.append(round(time.monotonic() - switch.decided_s, 2))
            routed = state.active_pools == {p.name for p in desired}
            # serving: the switch to the new pools confirmed; a pool resized in place needs
            # no switch, so its new plan serves once its added replicas are all Ready
            resized = reason == "RolloutComplete" and switch.serving_s is None
            if routed and (outcome.switched or resized):
                switch.serving_s = time.monotonic()
                switch.started = [t for t in pools.timelines() if t.spawned >= switch.decided_wall]
        if reason == "RolloutComplete":
            if switch is not None:
                switch.complete_s = time.monotonic()
            return state
        time.sleep(interval_s)
    raise TimeoutError(f"rollout to {plan.describe()} did not complete in {timeout_s:g} s")


@dataclass
class DrillResult:
    baseline: dict[int, str]
    answers: list[Answer]
    switches: list[Switch]
    hung_clients: int


def run_drill(
    engines: LocalEngines,
    sequence: Sequence[Plan] = tuple(SEQUENCE),
    budget: int = 8,
    clients: int = 3,
    settle_between_s: float = 3.0,
    timeout_s: float = 300,
) -> DrillResult:
    """Start ``sequence[0]`` (a router must run at ``engines.router_url``), record each
    prompt's answer, then switch through the rest under traffic."""
    pools = LocalPools(engines)
    fleet = RouterFleet([engines.router_url], engines.token, timeout_s=5)
    try:
        state = converge(pools, fleet, sequence[0], RolloutState(), budget, None, timeout_s)
        messages = prompts()
        baseline = {}
        for i, m in enumerate(messages):
            answer = ask(engines.router_url, m, stream=False)
            if answer.error:
                raise RuntimeError(f"baseline prompt {i} failed: {answer.error}")
            baseline[i] = answer.text
        switches = []
        with Traffic(engines.router_url, clients) as traffic:
            time.sleep(settle_between_s)
            for before, after in itertools.pairwise(sequence):
                switch = Switch(before.describe(), after.describe(), time.monotonic())
                switches.append(switch)
                state = converge(pools, fleet, after, state, budget, switch, timeout_s)
                time.sleep(settle_between_s)
        return DrillResult(baseline, list(traffic.answers), switches, traffic.hung)
    finally:
        pools.stop_all()


# --- report ----------------------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return float(np.percentile(np.array(values), q))


# the engine's start-up phases (epd_engine.engine.startup), in order, and what each one covers
ENGINE_PHASES = (
    ("interpreter", "main"),  # process start to our code running (Python start-up)
    ("imports", "imports"),  # torch, FastAPI, the engine's modules
    ("model_load", "model_loaded"),  # checkpoint read into the model
    ("budgets", "budgets"),  # caches, runner, the token/image budget search (if not given)
    ("engine_rest", "engine_built"),  # tokenizer/processor, async engine
    ("server_start", "serving"),  # uvicorn, transfer backend, router link
    ("register", "registered"),  # first heartbeat the router accepted
)


def phases(s: Switch) -> dict[str, float] | None:
    """Where decision -> serving went, on the critical path: the new replica the rollout saw
    Ready last. ``spawn``: decision to its process start; the engine's phases; ``seen_ready``:
    registered to a rollout pass seeing it; ``switch``: that pass to the routing confirmed by
    every router replica. Also ``replicas``: how many started and their start-to-ready spread."""
    if s.serving_s is None or not s.started:
        return None
    seen = [t for t in s.started if t.ready is not None]
    if not seen:
        return None
    last = max(seen, key=lambda t: t.ready or 0.0)
    out: dict[str, float] = {"spawn": last.spawned - s.decided_wall}
    at = last.spawned
    for name, key in ENGINE_PHASES:
        if key in last.phases:
            out[name] = last.phases[key] - at
            at = last.phases[key]
    assert last.ready is not None
    out["seen_ready"] = last.ready - at
    serving_wall = s.decided_wall + (s.serving_s - s.decided_s)
    out["switch"] = serving_wall - last.ready
    out = {k: round(v, 2) for k, v in out.items()}
    spread = [(t.ready or 0.0) - t.spawned for t in seen]
    out["replicas_started"] = len(s.started)
    out["replica_start_to_ready_min_s"] = round(min(spread), 2)
    out["replica_start_to_ready_max_s"] = round(max(spread), 2)
    return out


def report(result: DrillResult, margin_s: float = 1.0) -> dict[str, Any]:
    """Failures, mismatches, and TTFT (streaming answers) around each switch vs steady state."""
    windows = [
        (s.decided_s - margin_s, (s.complete_s or s.decided_s) + margin_s) for s in result.switches
    ]

    def in_window(a: Answer, lo: float, hi: float) -> bool:
        return a.start_s < hi and a.end_s > lo

    t0 = min((a.start_s for a in result.answers), default=0.0)  # traffic's clock, for "at_s"
    ttfts = [a for a in result.answers if a.ttft_s is not None and not a.error]
    steady = [a.ttft_s for a in ttfts if not any(in_window(a, lo, hi) for lo, hi in windows)]
    per_switch: list[dict[str, Any]] = []
    for s, (lo, hi) in zip(result.switches, windows, strict=True):
        around = [a.ttft_s for a in ttfts if in_window(a, lo, hi)]
        served = [a for a in result.answers if in_window(a, lo, hi)]
        per_switch.append(
            {
                "from": s.before,
                "to": s.after,
                "decision_to_serving_s": None
                if s.serving_s is None
                else round(s.serving_s - s.decided_s, 2),
                "decision_to_complete_s": None
                if s.complete_s is None
                else round(s.complete_s - s.decided_s, 2),
                # decision, new plan serving, rollout complete: seconds since traffic began
                "at_s": [
                    None if t is None else round(t - t0, 2)
                    for t in (s.decided_s, s.serving_s, s.complete_s)
                ],
                "load_avg_at_decision": [round(x, 2) for x in s.load_avg],
                "progress": s.progress,
                "progress_at_s": s.progress_at_s,
                "decision_to_serving_phases_s": phases(s),
                "requests_spanning": len(served),
                "ttft_p50_s": _pct([t for t in around if t is not None], 50),
                "ttft_p99_s": _pct([t for t in around if t is not None], 99),
            }
        )
    failed = [a for a in result.answers if a.error]
    mismatched = [a for a in result.answers if not a.error and a.text != result.baseline[a.prompt]]
    steady_values = [t for t in steady if t is not None]
    return {
        "requests": len(result.answers),
        "failed": len(failed),
        "failures": [a.error for a in failed[:10]],
        "hung_clients": result.hung_clients,
        "mismatched_outputs": len(mismatched),
        "steady": {
            "requests": len(steady_values),
            "ttft_p50_s": _pct(steady_values, 50),
            "ttft_p99_s": _pct(steady_values, 99),
        },
        "switches": per_switch,
        "max_decision_to_serving_s": max(
            (p["decision_to_serving_s"] or 0.0 for p in per_switch), default=None
        ),
        "median_decision_to_serving_s": statistics.median(
            [p["decision_to_serving_s"] for p in per_switch if p["decision_to_serving_s"]] or [0.0]
        ),
        "decision_to_serving_phases_median_s": _median_phases(
            [p["decision_to_serving_phases_s"] for p in per_switch]
        ),
    }


def _median_phases(per_switch: list[dict[str, float] | None]) -> dict[str, float]:
    """Each phase's median over the switches that report it."""
    known = [p for p in per_switch if p]
    names = dict.fromkeys(k for p in known for k in p)
    return {k: round(statistics.median([p[k] for p in known if k in p]), 2) for k in names}


def main(argv: list[str] | None = None) -> int:
    import contextlib
    import secrets
    import subprocess
    import sys

    from epd_engine.local.ports import free_port

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="tiny-llava checkpoint dir")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--run-dir", type=Path, default=Path("runs/switch-bench"))
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument(
        "--steady-s", type=float, default=15.0, help="steady traffic between two switches"
    )
    parser.add_argument(
        "--plans", type=int, default=len(SEQUENCE), help="run only the first N plans"
    )
    args = parser.parse_args(argv)

    load_before = os.getloadavg()
    token = secrets.token_hex(16)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args.run_dir.mkdir(parents=True, exist_ok=True)
    log = (args.run_dir / "router.log").open("wb")
    router = subprocess.Popen(
        [sys.executable, "-m", "epd_engine", "router", "--model", MODEL_NAME, "--host",
         "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "EPD_INTERNAL_TOKEN": token},
    )  # fmt: skip
    try:
        engines = LocalEngines(args.model, MODEL_NAME, url, args.run_dir, token, ENGINE_ARGS)
        result = run_drill(
            engines, SEQUENCE[: args.plans], clients=args.clients, settle_between_s=args.steady_s
        )
    finally:
        router.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            router.wait(10)
    out = report(result)
    out["sequence"] = [p.describe() for p in SEQUENCE[: args.plans]]
    out["clients"] = args.clients
    out["steady_between_switches_s"] = args.steady_s
    out["machine"] = f"{os.cpu_count()} CPUs, CPU engines (float32), tiny-llava"
    out["load_avg_before"] = [round(x, 2) for x in load_before]
    out["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    # every answer (its text, times, error) in the raw file beside the summary
    write_results(args.out, out, {"answers": [asdict(a) for a in result.answers]})
    print(json.dumps(out, indent=2))
    return 0 if out["failed"] == 0 and out["mismatched_outputs"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
