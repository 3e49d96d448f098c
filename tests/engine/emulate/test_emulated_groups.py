"""Two placement groups of emulated E, P and D instances, each group one ``epdctl group``
supervisor, behind the real router (real processes on loopback): a request entering a
group's E is handed to the same group's P and D, which every instance counts in
``epd_handoffs_total{locality="group"}``.

All six run on one node and are equally idle, so without the group preference the id order
(or the affinity key) would send group A's requests to group B's P and D: B's sort first."""

from __future__ import annotations

import secrets
import shlex
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.processes import free_port, running, wait_ready

REPO = Path(__file__).resolve().parents[3]
COST_MODEL = REPO / "benchmarks" / "results" / "cost-model-h200.json"
MODEL = "llava-1.5-7b-emulated"
# group -> its members' ids by role; group B's P and D sort before group A's
GROUPS = {
    "pod-a": {"E": "a-e", "P": "y-p", "D": "y-d"},
    "pod-b": {"E": "b-e", "P": "x-p", "D": "x-d"},
}
NUM_REQUESTS = 8
HEARTBEAT_S = 0.5  # disagg/router_link.py's default


def test_hand_offs_stay_in_the_entry_group_while_loads_are_balanced(tmp_path: Path) -> None:
    env = {"EPD_INTERNAL_TOKEN": secrets.token_hex(16)}
    router_port = free_port()
    router_url = f"http://127.0.0.1:{router_port}"
    router_args = ["router", "--model", MODEL, "--port", str(router_port), "--log-level", "warning"]
    ports = {i: free_port() for members in GROUPS.values() for i in members.values()}

    def group(name: str) -> list[str]:
        args = ["group", "--name", name, "--stop-timeout", "5"]
        for role, instance_id in GROUPS[name].items():
            member = ["serve", "--emulate", str(COST_MODEL), "--role", role, "--pool", role.lower(),
                      "--instance-id", instance_id, "--port", str(ports[instance_id]),
                      "--router-url", router_url, "--log-level", "warning"]  # fmt: skip
            args += ["--member", shlex.join(member)]
        return args

    def ready(instance_id: str) -> str:
        return f"http://127.0.0.1:{ports[instance_id]}/health/ready"

    with (
        running(router_args, f"{router_url}/health/live", tmp_path / "router.log", env),
        running(group("pod-a"), ready("a-e"), tmp_path / "a.log", env) as a,
        running(group("pod-b"), ready("b-e"), tmp_path / "b.log", env) as b,
    ):
        for proc, log, name in ((a, tmp_path / "a.log", "pod-a"), (b, tmp_path / "b.log", "pod-b")):
            for instance_id in GROUPS[name].values():
                wait_ready(ready(instance_id), proc, log)
        # the router keeps each member's group and hands it on in its table
        assert _groups(router_url, env, len(ports)) == {
            i: name for name, members in GROUPS.items() for i in members.values()
        }
        client = openai.OpenAI(base_url=f"{router_url}/v1", api_key="unused")
        for i in range(NUM_REQUESTS):  # one at a time: every instance idle at each hand-off
            _wait_until_quiet(router_url, env)
            answer = client.chat.completions.create(
                model=MODEL, messages=_picture_question(i), max_tokens=3
            )
            assert answer.usage is not None and answer.usage.completion_tokens == 3
        counts = {i: _handoffs(f"http://127.0.0.1:{port}/metrics") for i, port in ports.items()}
    # both groups took requests in (the router spreads images by their keys)
    assert counts["a-e"] and counts["b-e"], counts
    for instance_id, by_locality in counts.items():
        assert set(by_locality) <= {"group"}, (instance_id, by_locality)
    assert sum(n for c in counts.values() for n in c.values()) == 2 * NUM_REQUESTS  # E->P, P->D


def _picture_question(i: int) -> list[Any]:
    image = {"type": "image_url", "image_url": {"url": f"https://example.com/{i}.png"}}
    return [{"role": "user", "content": [image, {"type": "text", "text": f"what is in {i}?"}]}]


def _groups(router_url: str, env: dict[str, str], count: int) -> dict[str, str]:
    """Each registered instance's group, once ``count`` have registered."""
    headers = {"X-EPD-Token": env["EPD_INTERNAL_TOKEN"]}
    deadline = time.monotonic() + 20
    while True:
        pools = httpx.get(f"{router_url}/internal/pools", headers=headers).json()["pools"]
        loads = [load for pool in pools.values() for load in pool["instances"]]
        if len(loads) >= count:
            return {load["instance_id"]: load.get("group", "") for load in loads}
        assert time.monotonic() < deadline, pools
        time.sleep(0.2)


def _wait_until_quiet(router_url: str, env: dict[str, str]) -> None:
    """Until the router's table shows every instance idle, then two heartbeats more: each
    instance sees its peers' loads in its heartbeat answers, and a table from before the last
    request finished (a peer still "waiting") rightly sends a hand-off out of the group. On a
    loaded CI host that stale table once did, which is not what this test is about."""
    headers = {"X-EPD-Token": env["EPD_INTERNAL_TOKEN"]}
    deadline = time.monotonic() + 20
    while True:
        pools = httpx.get(f"{router_url}/internal/pools", headers=headers).json()["pools"]
        loads = [load for pool in pools.values() for load in pool["instances"]]
        if not any(load.get("num_waiting") or load.get("num_running") for load in loads):
            break
        assert time.monotonic() < deadline, pools
        time.sleep(0.1)
    time.sleep(2 * HEARTBEAT_S)


def _handoffs(metrics_url: str) -> dict[str, float]:
    """This instance's hand-offs by locality (kinds summed)."""
    out: dict[str, float] = {}
    for line in httpx.get(metrics_url).text.splitlines():
        if line.startswith("epd_handoffs_total{"):
            where = line.split('locality="', 1)[1].split('"', 1)[0]
            out[where] = out.get(where, 0.0) + float(line.rsplit(" ", 1)[1])
    return out
