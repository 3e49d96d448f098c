"""The fast path in the running loop (issue 32 item 3): emulated E, P and D instances behind
the real router, driven by ``LocalRun``'s passes (what ``epdctl up --emulate`` runs). A load
step of image requests outruns the one encoder: within a scrape window the loop adds an E
instance through the rollout, long before the next re-plan is due, and no request fails.

The H200 cost model's encoder takes 2.6 ms an image: no 2-core machine sends enough to load
it. The test's copy takes 250 ms (4 rps an encoder), so that encode is the bottleneck at
8 rps; the TPOT objective is loose, so that CPU contention on a shared 2-core host (the
router, three instances and the client on it) does not alarm decode."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import httpx
import yaml

from epd_engine.config import Method, Role
from epd_engine.contracts.plan import Plan
from epd_operator.api.spec import PlanStatus
from epd_operator.local.reconciler import LocalStatus
from epd_operator.local.run import LocalRun, Options
from epd_operator.planning.plan_pass import PlanMemory
from epd_operator.rollout.alarm_reader import AlarmReader
from tests.processes import free_port

REPO = Path(__file__).resolve().parents[2]
COST_MODEL = REPO / "benchmarks" / "results" / "cost-model-h200.json"
START = Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 1, Role.D: 1}, reason="start")


def slow_encoder(tmp_path: Path) -> Path:
    costs = json.loads(COST_MODEL.read_text())
    per_image = 0.25 / costs["capacity"]["tokens_per_image"]  # a batch of images takes no less
    costs["encode"] = {"fixed_s": 0.0, "per_token_s": per_image, "knee_tokens": 0.0}
    path = tmp_path / "cost-model-slow-encoder.json"
    path.write_text(json.dumps(costs))
    return path


def manifest() -> str:
    spec = {
        "model": {"name": "llava-1.5-7b", "source": {"preset": "tiny-llava"}},
        # maxGPUs: room for one more instance; gpuBudget: for the grown pool next to the old
        "gpuBudget": 6,
        "capacity": {"minGPUs": 1, "maxGPUs": 4},
        "slo": {"ttftMilliseconds": 1000, "tpotMilliseconds": 1000},
        "disaggregation": {"mode": "Auto"},
    }
    return yaml.safe_dump(
        {"apiVersion": "epd.serving.dev/v1alpha1", "kind": "EPDDeployment",
         "metadata": {"name": "fast"}, "spec": spec}
    )  # fmt: skip


def serves_two_encoders(status: LocalStatus) -> bool:
    """The routing confirmed on the plan's E pool of 2 instances."""
    return status.plan == "E+P+D 2E1P1D" and any(
        status.pools.get(name, {}).get("replicas") == 2 and status.pools[name]["role"] == "E"
        for name in status.active_pools
    )


class Traffic:
    """Image requests at a set rate from a thread pool; counts answers and failures."""

    def __init__(self, url: str) -> None:
        self.url, self.rate = url, 1.0
        self.sent = self.ok = self.failed = 0
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.pool = ThreadPoolExecutor(64)
        self.thread = threading.Thread(target=self._send, daemon=True)

    def _one(self, i: int) -> None:
        body = {
            "model": "llava-1.5-7b-emulated",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "what is this"},
                {"type": "image_url", "image_url": {"url": f"http://images.invalid/{i}.png"}},
            ]}],
        }  # fmt: skip
        try:
            r = httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=60)
            r.raise_for_status()
            self.ok += 1
        except httpx.HTTPError as exc:
            self.failed += 1
            self.errors.append(repr(exc))

    def _send(self) -> None:
        i, next_s = 0, time.monotonic()
        while not self.stop.is_set():
            self.pool.submit(self._one, i)
            i += 1
            self.sent = i
            next_s += 1 / self.rate
            time.sleep(max(0.0, next_s - time.monotonic()))

    def finish(self) -> None:
        self.stop.set()
        self.thread.join()
        self.pool.shutdown(wait=True)


def test_a_load_step_makes_the_fast_path_add_an_encoder(tmp_path: Path) -> None:
    opts = Options(
        "fast", "llava-1.5-7b", tmp_path / "model", tmp_path / "run", free_port(),
        interval_s=0.5, emulate=slow_encoder(tmp_path),
    )  # fmt: skip
    run = LocalRun(opts, manifest())
    run.reconciler.alarms = AlarmReader(3.0)
    # the loop starts at 1E1P1D, just planned: the next re-plan is due in 300 s
    run.reconciler.memory = PlanMemory(
        plan=PlanStatus.from_plan(START, 1), last_planned=datetime.now(UTC)
    )
    traffic = Traffic(run.router_url)
    try:
        run._start_routers()
        deadline = time.monotonic() + 60
        while not run.pass_once().complete:
            assert time.monotonic() < deadline, "the first rollout did not complete"
            time.sleep(0.5)
        traffic.thread.start()
        time.sleep(4)  # 1 rps: the encoder keeps up, nothing alarms
        assert run.pass_once().plan == "E+P+D 1E1P1D"

        traffic.rate = 8.0  # the step: twice what one encoder serves
        stepped = time.monotonic()
        status = run.pass_once()
        while not serves_two_encoders(status):
            assert time.monotonic() - stepped < 90, f"no fast scale-up: {status}"
            time.sleep(0.5)
            status = run.pass_once()
        took_s = time.monotonic() - stepped
        print(f"load step to the new E pool serving: {took_s:.1f} s")
        traffic.rate = 1.0  # the old encoder drains its backlog; nothing may be lost
        while not status.complete:
            assert time.monotonic() - stepped < 150, f"the old E pool did not drain: {status}"
            time.sleep(0.5)
            status = run.pass_once()
        traffic.finish()
    finally:
        traffic.stop.set()
        run.stop()

    why = status.decision
    assert why is not None and why["outcome"] == "FastScaledUp", why
    assert why["stage"] == "encode" and why["planBefore"] == "E+P+D 1E1P1D"
    assert why["plan"] == "E+P+D 2E1P1D" and why["gpus"] == 4
    assert "queue" in why["alarm"] or "TTFT attainment" in why["alarm"]
    assert status.conditions["Planned"][1] == "FastScaledUp"
    # the step's decision to the new pool serving, well before the re-plan due in 300 s
    assert took_s < 90
    assert traffic.failed == 0, traffic.errors[:3]
    # every request sent was answered. How many depends on how fast the step was served: a
    # floor of 50 failed CI when the scale-up took 4.4 s (41 sent), one of 20 when forked
    # emulated instances served it in 1.8 s (16 sent); 8 is what 4 s at 1 rps and one
    # second of the step send at the least
    assert traffic.ok == traffic.sent >= 8, (traffic.ok, traffic.sent)
