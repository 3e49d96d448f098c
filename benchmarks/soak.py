"""A soak: hours of mixed traffic through a reconciled local deployment that switches plans.

``epdctl up --reconcile`` of an E+P+D manifest (tiny model, CPU), three clients asking text
and image questions, streaming and not, and an ``epdctl apply`` every ``--switch-every-s``
(300) cycling through a ratio switch (1E1P1D -> 1E1P2D) and method switches (-> E+PD 1E1PD
-> back to E+P+D). The encode pool (one replica) is in every plan, so its process, the router
and the supervisor live the whole run; prefill and decode pools are replaced by switches.

Every ``--sample-every-s`` it records each process of the run (the supervisor and all its
descendants: routers, engines, their workers): resident memory (VmRSS) and open file
descriptors, and the entries of ``/dev/shm``. At the end, with traffic stopped, it reads every
instance's free KV and image pages from the router (the heartbeats) against their capacity
(``epd_cache_capacity_pages``), then stops the run and checks that nothing is left behind.

It passes when: 0 failed and 0 hung requests; every process observed long enough after its
warm-up is flat (median RSS of its last fifth of samples within 10 % of its first fifth; for
those sampled over three switches, median open descriptors within 10 % + 2); no page is held
by a request when idle; ``/dev/shm`` has as many entries after the run as before it; no
process of the run is left.

``python -m benchmarks.soak --model DIR --duration-s 3600 --out FILE.json`` (``make
bench-soak``); a 5-minute version runs in the tests (``tests/operator/test_soak.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.switch_drill import MODEL_NAME, Answer, Traffic
from epd_engine.bench.results_file import write_results
from epd_engine.local.ports import free_port
from epd_engine.local.state_file import read_state

NAME = "soak"
# each a switch from the one before (the last back to the first): ratio, method, method
PLANS: list[tuple[str, dict[str, int]]] = [
    ("E+P+D", {"E": 1, "P": 1, "D": 1}),
    ("E+P+D", {"E": 1, "P": 1, "D": 2}),
    ("E+PD", {"E": 1, "PD": 1}),
]
RSS_TOLERANCE = 0.10
FD_TOLERANCE = 0.10
FD_SLACK = 2  # connections come and go: a couple of descriptors either way is not a leak
MIN_SAMPLES = 10  # a process sampled fewer times after its warm-up is not judged


def manifest(method: str, pools: dict[str, int], router_replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": "epd.serving.dev/v1alpha1",
        "kind": "EPDDeployment",
        "metadata": {"name": NAME},
        "spec": {
            "model": {"name": MODEL_NAME, "source": {"preset": "tiny-llava"}},
            "gpuBudget": 8,
            "disaggregation": {"mode": "Fixed", "method": method, "pools": pools},
            "router": {"replicas": router_replicas},
            "engine": {
                "gpusPerInstance": 0,
                "numKvBlocks": 256,
                "numImageBlocks": 16,
                "extraArgs": [
                    "--max-num-running",
                    "16",
                    "--token-budget",
                    "256",
                    "--image-budget",
                    "4",
                ],
            },
            "rollout": {"drainTimeoutSeconds": 120},
        },
    }


# --- processes ---------------------------------------------------------------------------------


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out.setdefault(ppid, []).append(int(entry.name))
    return out


def descendants(root: int) -> list[int]:
    """``root`` and every process under it."""
    children = _children()
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def process_name(pid: int, root: int, names: dict[int, str]) -> str:
    """The supervisor, a router (by port), an engine (by instance id), or a child of one."""
    if pid == root:
        return "supervisor"
    try:
        # split on spaces too: a process forked from the zygote shows one titled string
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().split()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return f"gone-{pid}"
    ppid = int(stat.rsplit(")", 1)[1].split()[1])
    if "--instance-id" in argv:
        return f"engine {argv[argv.index('--instance-id') + 1]}"
    if "router" in argv and "--port" in argv:
        return f"router :{argv[argv.index('--port') + 1]}"
    comm = stat.split("(", 1)[1].rsplit(")", 1)[0]
    return f"{names.get(ppid, str(ppid))} / {comm}"


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def num_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def shm_entries() -> list[str]:
    try:
        return sorted(os.listdir("/dev/shm"))
    except OSError:
        return []


def shm_held(pid: int) -> set[str]:
    """The ``/dev/shm`` entries ``pid`` maps or holds open: what a segment left behind by the
    run is told apart by (the host's ``/dev/shm`` is shared with everything else running)."""
    held: set[str] = set()
    try:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            if "/dev/shm/" in line:
                held.add(line.rsplit("/dev/shm/", 1)[1].removesuffix(" (deleted)"))
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            target = os.readlink(fd)
            if target.startswith("/dev/shm/"):
                held.add(target.removeprefix("/dev/shm/").removesuffix(" (deleted)"))
    except OSError:  # the process ended meanwhile
        pass
    return held


@dataclass
class Sample:
    t_s: float  # since the run was up
    pid: int
    name: str
    rss_kib: int
    fds: int


@dataclass
class Sampler:
    root: int
    every_s: float
    t0: float
    samples: list[Sample] = field(default_factory=list)
    shm: list[tuple[float, int]] = field(default_factory=list)
    shm_of_run: set[str] = field(default_factory=set)  # entries a process of the run held
    names: dict[int, str] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sample_once(self) -> None:
        t = round(time.monotonic() - self.t0, 2)
        for pid in descendants(self.root):
            if pid not in self.names:
                self.names[pid] = process_name(pid, self.root, self.names)
            rss, fds = rss_kib(pid), num_fds(pid)
            if rss is not None and fds is not None:
                self.samples.append(Sample(t, pid, self.names[pid], rss, fds))
            self.shm_of_run |= shm_held(pid)
        self.shm.append((t, len(shm_entries())))

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample_once()

    def start(self) -> None:
        self.sample_once()
        self._thread = threading.Thread(target=self._run, daemon=True, name="soak-sampler")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)


# --- analysis (pure: tested on its own) ----------------------------------------------------------


def _fifths(values: list[int]) -> tuple[float, float]:
    n = max(1, len(values) // 5)
    return statistics.median(values[:n]), statistics.median(values[-n:])


def flatness(
    samples: Sequence[Sample], warmup_s: float, process_warmup_s: float, fds_min_life_s: float
) -> list[dict]:
    """Per process: its samples after the run's warm-up and its own (from its first sample),
    the median RSS and descriptors of the first and the last fifth of them, and whether each
    stayed flat. Processes with fewer than ``MIN_SAMPLES`` such samples are listed, unjudged.

    Descriptors are judged only for processes sampled over ``fds_min_life_s`` (the soak: three
    switches): a process holds sockets per peer, so one that saw a single switch (one decode
    instance, then two) may end with more for good reason; a leak shows as growth over many
    switches (the router's kept connections to retired instances did, 26 -> 40 in an hour)."""
    by_pid: dict[int, list[Sample]] = {}
    for s in samples:
        by_pid.setdefault(s.pid, []).append(s)
    out = []
    for pid, own in sorted(by_pid.items(), key=lambda kv: kv[1][0].t_s):
        born = own[0].t_s
        kept = [s for s in own if s.t_s >= max(warmup_s, born + process_warmup_s)]
        row: dict[str, Any] = {
            "pid": pid,
            "name": own[0].name,
            "first_seen_s": born,
            "last_seen_s": own[-1].t_s,
            "samples_judged": len(kept),
            "max_rss_mib": round(max(s.rss_kib for s in own) / 1024, 1),
        }
        if len(kept) >= MIN_SAMPLES:
            rss_first, rss_last = _fifths([s.rss_kib for s in kept])
            fd_first, fd_last = _fifths([s.fds for s in kept])
            row.update(
                rss_first_mib=round(rss_first / 1024, 1),
                rss_last_mib=round(rss_last / 1024, 1),
                rss_growth=round(rss_last / rss_first - 1, 4),
                fds_first=fd_first,
                fds_last=fd_last,
                rss_flat=rss_last <= rss_first * (1 + RSS_TOLERANCE),
            )
            if kept[-1].t_s - kept[0].t_s >= fds_min_life_s:
                row["fds_flat"] = fd_last <= fd_first * (1 + FD_TOLERANCE) + FD_SLACK
        out.append(row)
    return out


def request_counts(answers: Sequence[Answer], timeout_s: float) -> dict[str, Any]:
    """Failed and hung (no answer within the client timeout) requests, by kind."""
    hung = [a for a in answers if "Timeout" in a.error or a.end_s - a.start_s >= timeout_s]
    failed = [a for a in answers if a.error and a not in hung]
    e2e = sorted(a.end_s - a.start_s for a in answers if not a.error)
    return {
        "requests": len(answers),
        "streaming": sum(a.stream for a in answers),
        "with_images": sum(a.prompt >= 3 for a in answers),
        "failed": len(failed),
        "hung": len(hung),
        "errors": sorted({a.error[:200] for a in [*failed, *hung]}),
        "e2e_p50_s": round(e2e[len(e2e) // 2], 3) if e2e else None,
        "e2e_p99_s": round(e2e[int(len(e2e) * 0.99)], 3) if e2e else None,
        "e2e_max_s": round(e2e[-1], 3) if e2e else None,
    }


# --- the run -------------------------------------------------------------------------------------


def _epdctl(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "epd_engine", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def _capacity(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        s.labels["cache"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "epd_cache_capacity_pages"
    }


def pages_in_use(router_urls: Sequence[str], token: str) -> tuple[list[dict[str, Any]], int]:
    """Every instance's KV and image pages held by requests (capacity - free in its latest
    heartbeat, as each router replica sees it), and the requests in flight on the routers."""
    rows, inflight = [], 0
    for router in router_urls:
        body = httpx.get(
            f"{router}/internal/pools", headers={"X-EPD-Token": token}, timeout=10
        ).json()
        for pool in body["pools"].values():
            inflight += int(pool["inflight"])
            for inst in pool["instances"]:
                try:
                    cap = _capacity(inst["url"])
                except httpx.ConnectError:  # a replaced pool's instance, stopped: the router
                    continue  # lists it until its heartbeats time out (a switch just before)
                rows.append(
                    {
                        "router": router,
                        "instance": inst["instance_id"],
                        "kv_used": int(cap.get("kv", 0)) - int(inst["free_kv_blocks"]),
                        "image_used": int(cap.get("image", 0)) - int(inst["free_image_blocks"]),
                        "running": int(inst["num_running"]),
                        "waiting": int(inst["num_waiting"]),
                    }
                )
    return rows, inflight


def wait_idle(router_urls: Sequence[str], token: str, timeout_s: float) -> list[dict[str, Any]]:
    """Pages in use once nothing is in flight and no page is held (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows, inflight = pages_in_use(router_urls, token)
        idle = inflight == 0 and all(
            r["kv_used"] == r["image_used"] == r["running"] == r["waiting"] == 0 for r in rows
        )
        if idle or time.monotonic() > deadline:
            return rows
        time.sleep(1.0)


def wait_complete(run_dir: Path, generation: int, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = read_state(run_dir) or {}
        status = state.get("status") or {}
        if state.get("observed_generation") == generation and status.get("phase") == (
            "RolloutComplete"
        ):
            return status
        if state.get("spec_error"):
            raise RuntimeError(f"the manifest was refused: {state['spec_error']}")
        time.sleep(0.5)
    raise TimeoutError(f"generation {generation} did not complete in {timeout_s:g} s")


def soak(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="epd-soak-"))
    runs = work / "runs"
    run_dir = runs / NAME
    shm_before = shm_entries()
    files = []
    for i, (method, pools) in enumerate(PLANS):
        f = work / f"plan-{i}.yaml"
        f.write_text(yaml.safe_dump(manifest(method, pools, args.router_replicas)))
        files.append(f)
    up = _epdctl(
        "up", "-f", str(files[0]), "--model-dir", str(args.model), "--port", str(free_port()),
        "--reconcile", "--detach", "--timeout", "600", "--runs-dir", str(runs),
        timeout_s=720,
    )  # fmt: skip
    if up.returncode != 0:
        raise RuntimeError(f"epdctl up failed:\n{up.stdout}\n{up.stderr}")
    state = read_state(run_dir)
    assert state is not None
    root, token = int(state["pid"]), str(state["token"])
    router_urls = list(state.get("router_urls") or [state["router_url"]])
    t0 = time.monotonic()
    sampler = Sampler(root, args.sample_every_s, t0)
    sampler.start()
    switches: list[dict[str, Any]] = []
    traffic = Traffic(state["router_url"], clients=args.clients)
    generation = 1
    try:
        with traffic:
            plan = 0
            while True:
                next_switch = t0 + (len(switches) + 1) * args.switch_every_s
                end = t0 + args.duration_s
                time.sleep(max(0.0, min(next_switch, end) - time.monotonic()))
                if time.monotonic() >= end:
                    break
                plan = (plan + 1) % len(PLANS)
                decided = time.monotonic()
                applied = _epdctl("apply", "-f", str(files[plan]), "--runs-dir", str(runs))
                if applied.returncode != 0:
                    raise RuntimeError(f"epdctl apply failed:\n{applied.stdout}{applied.stderr}")
                generation += 1
                status = wait_complete(run_dir, generation, args.switch_timeout_s)
                switches.append(
                    {
                        "at_s": round(decided - t0, 1),
                        "to": status.get("plan"),
                        "complete_after_s": round(time.monotonic() - decided, 1),
                    }
                )
        hung_clients = traffic.hung
        pages = wait_idle(router_urls, token, timeout_s=60)
        sampler.sample_once()  # idle, after the last request
    finally:
        sampler.stop()
        alive_before_down = descendants(root)
        down = _epdctl("down", NAME, "--runs-dir", str(runs), timeout_s=180)
    time.sleep(2)
    left = [pid for pid in alive_before_down if Path(f"/proc/{pid}").exists()]
    shm_after = shm_entries()
    answers = traffic.answers
    counts = request_counts(answers, args.request_timeout_s)
    counts["hung"] += hung_clients
    fds_min_life_s = 3 * args.switch_every_s
    processes = flatness(sampler.samples, args.warmup_s, args.process_warmup_s, fds_min_life_s)
    judged = [p for p in processes if "rss_flat" in p]
    fds_judged = [p for p in processes if "fds_flat" in p]
    checks = {
        "no_failed": counts["failed"] == 0,
        "no_hung": counts["hung"] == 0,
        "rss_flat": bool(judged) and all(p["rss_flat"] for p in judged),
        "fds_flat": bool(fds_judged) and all(p["fds_flat"] for p in fds_judged),
        "no_pages_held_when_idle": bool(pages)
        and all(p["kv_used"] == p["image_used"] == 0 for p in pages),
        # the run's own: an entry left that one of its processes held (others on the host
        # come and go; their count is reported, not judged)
        "no_shm_left": not (set(shm_after) - set(shm_before)) & sampler.shm_of_run,
        "no_process_left": not left and down.returncode == 0,
        "switches_completed": len(switches) >= 1,
    }
    summary = {
        "passed": all(checks.values()),
        "checks": checks,
        "duration_s": args.duration_s,
        "switch_every_s": args.switch_every_s,
        "plans": [f"{m} {pools}" for m, pools in PLANS],
        "clients": args.clients,
        "router_replicas": args.router_replicas,
        "warmup_s": args.warmup_s,
        "process_warmup_s": args.process_warmup_s,
        "fds_min_life_s": fds_min_life_s,
        "sample_every_s": args.sample_every_s,
        **counts,
        "switches": switches,
        "processes": processes,
        "pages_when_idle": pages,
        "shm_entries": {
            "before": len(shm_before),
            "after": len(shm_after),
            "max_during": max((n for _, n in sampler.shm), default=0),
            "held_by_the_run": sorted(sampler.shm_of_run),
            "left_by_the_run": sorted((set(shm_after) - set(shm_before)) & sampler.shm_of_run),
        },
        "processes_left": left,
    }
    raw = {
        "samples": [asdict(s) for s in sampler.samples],
        "shm": sampler.shm,
        "answers": [asdict(a) for a in answers],
    }
    write_results(args.out, summary, raw)
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="tiny-llava checkpoint dir")
    p.add_argument("--out", type=Path, required=True, help="summary JSON (raw data in raw/)")
    p.add_argument("--duration-s", type=float, default=3600.0)
    p.add_argument("--switch-every-s", type=float, default=300.0)
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--router-replicas", type=int, default=1)
    p.add_argument("--sample-every-s", type=float, default=10.0)
    p.add_argument("--warmup-s", type=float, default=120.0, help="samples before are not judged")
    p.add_argument(
        "--process-warmup-s", type=float, default=120.0, help="nor a process's first seconds"
    )
    p.add_argument("--switch-timeout-s", type=float, default=600.0)
    p.add_argument("--request-timeout-s", type=float, default=120.0, help="slower is hung")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    summary = soak(args)
    brief = {k: v for k, v in summary.items() if k not in ("processes", "pages_when_idle")}
    print(json.dumps(brief, indent=2))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
