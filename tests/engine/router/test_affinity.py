"""Routing by cache affinity within a load bound (contracts/affinity.py, router/
affinity_key.py): the policy on its own, and driving three real schedulers with prefix caches
through a multi-turn workload."""

from __future__ import annotations

import itertools
import random
from typing import Any

from epd_engine.api.completions import CompletionRequest
from epd_engine.api.protocol import ChatCompletionRequest
from epd_engine.cache.kv_cache import KVCacheManager
from epd_engine.config import Role
from epd_engine.contracts.affinity import Affinity, LoadBound, PrefixAffinity, preferred
from epd_engine.contracts.routing_policy import InstanceLoad, LeastLoaded
from epd_engine.request import Request
from epd_engine.router.affinity_key import image_key, prefix_key
from epd_engine.sampling import SamplingParams
from epd_engine.scheduler import Scheduler, SchedulerLimits

BLOCK = 4


def _load(instance_id: str, depth: int = 0) -> InstanceLoad:
    return InstanceLoad(instance_id, f"http://{instance_id}", Role.PD, "pd", num_waiting=depth)


def test_a_key_prefers_one_instance_and_keeps_it_when_another_leaves() -> None:
    loads = [_load(f"i{k}") for k in range(4)]
    keys = [f"conversation-{k}" for k in range(200)]
    before = {key: preferred(loads, key).instance_id for key in keys}
    assert len(set(before.values())) == 4  # keys spread over every instance
    after = {key: preferred(loads[1:], key).instance_id for key in keys}
    moved = [key for key in keys if before[key] != after[key]]
    assert moved and all(before[key] == "i0" for key in moved)  # only the leaver's keys moved


def test_the_load_bound_overrides_affinity_and_no_key_goes_to_the_least_loaded() -> None:
    policy = PrefixAffinity(LoadBound(slack_requests=2, slack_ratio=0.5))
    key = "k"
    loads = [_load(f"i{k}") for k in range(3)]
    best = preferred(loads, key).instance_id
    busy = [_load(i.instance_id, 2 if i.instance_id == best else 0) for i in loads]
    assert policy.decide(busy, key) == (next(i for i in busy if i.instance_id == best), "followed")
    busier = [_load(i.instance_id, 3 if i.instance_id == best else 0) for i in loads]
    target, outcome = policy.decide(busier, key)
    assert outcome is Affinity.OVERRIDDEN and target.instance_id != best
    # the bound grows with the load: 10 more than 20 is within half of 20
    scaled = [_load(i.instance_id, 30 if i.instance_id == best else 20) for i in loads]
    assert policy.decide(scaled, key)[1] is Affinity.FOLLOWED
    assert policy.decide(loads, None) == (LeastLoaded().choose(loads), Affinity.NONE)
    assert policy.counts == {Affinity.FOLLOWED: 2, Affinity.OVERRIDDEN: 1, Affinity.NONE: 1}


def _chat(*messages: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": list(messages)})


def test_keys_follow_the_conversation_opening() -> None:
    system = {"role": "system", "content": "Be brief."}
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    first = {"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]}
    turn1 = _chat(system, first)
    turn2 = _chat(system, first, {"role": "assistant", "content": "A cat."},
                  {"role": "user", "content": "Why?"})  # fmt: skip
    other = _chat(system, {"role": "user", "content": "Hello."})
    assert prefix_key(turn1) == prefix_key(turn2) != prefix_key(other)
    assert image_key(turn1) == image_key(turn2) is not None and image_key(other) is None
    prompt = CompletionRequest(model="m", prompt="x" * 2000)
    longer = CompletionRequest(model="m", prompt="x" * 2000 + "more")
    assert prefix_key(prompt) == prefix_key(longer) is not None


# ---- three prefill instances, one multi-turn workload ---------------------------------
def _instance(num_kv_blocks: int = 160) -> Scheduler:
    kv = KVCacheManager(num_kv_blocks, BLOCK, "model-a")
    return Scheduler(Role.PD, SchedulerLimits(48, 1, 16, 4096), kv, None)


def _serve(
    instances: dict[str, Scheduler], choose: object, num_sessions: int = 12, num_turns: int = 5
) -> tuple[float, list[tuple[int, int]]]:
    """Sessions' turns arrive round by round; each turn resends the conversation. Returns
    the prefix cache's hit rate over all instances and every placement's (chosen depth,
    least depth)."""
    rng = random.Random(1)
    ids = itertools.count()
    histories = {s: [rng.randrange(1000) for _ in range(rng.randint(20, 40))] for s in range(12)}
    placements: list[tuple[int, int]] = []
    for _ in range(num_turns):
        requests = []
        for session in rng.sample(range(num_sessions), num_sessions):
            history = histories[session]
            history += [rng.randrange(1000) for _ in range(rng.randint(4, 12))]  # the user
            loads = [
                InstanceLoad(name, "", Role.PD, "pd", len(s.waiting), len(s.running))
                for name, s in instances.items()
            ]
            target = choose(loads, f"session-{session}")  # type: ignore[operator]
            placements.append((target.queue_depth, min(load.queue_depth for load in loads)))
            request = Request(f"r{next(ids)}", list(history), SamplingParams(max_tokens=6))
            instances[target.instance_id].add(request)
            requests.append((session, request))
            for scheduler in instances.values():  # they run while requests arrive
                _step(scheduler)
        while any(s.has_work() for s in instances.values()):
            for scheduler in instances.values():
                _step(scheduler)
        for session, request in requests:
            histories[session] += request.output_token_ids  # the answer joins the history
    queried = sum(s.kv.num_queried_tokens for s in instances.values() if s.kv)
    hits = sum(s.kv.num_hit_tokens for s in instances.values() if s.kv)
    return hits / queried, placements


def _step(scheduler: Scheduler) -> None:
    out = scheduler.schedule()
    sampled = {t.request_id: 1 + len(t.token_ids) % 900 for t in out.token_tasks if t.sample}
    scheduler.update(out, sampled)


def test_three_instances_hit_nearly_as_often_as_one_within_the_load_bound() -> None:
    """With the default bound, 3 instances of 160 pages find 90 % of the tokens one
    instance of 480 pages would; routing by load alone loses most of them."""
    one, _ = _serve({"only": _instance(3 * 160)}, lambda loads, key: loads[0])
    policy = PrefixAffinity()
    three, placements = _serve({f"p{k}": _instance() for k in range(3)}, policy.choose)
    spread, _ = _serve(
        {f"p{k}": _instance() for k in range(3)}, lambda loads, key: LeastLoaded().choose(loads)
    )
    assert three >= 0.9 * one, (three, one)
    assert spread < 0.7 * three, (spread, three)
    assert all(policy.bound.allows(chosen, least) for chosen, least in placements)


def test_a_tight_bound_overrides_affinity_and_is_never_exceeded() -> None:
    policy = PrefixAffinity(LoadBound(slack_requests=1, slack_ratio=0.0))
    _, placements = _serve({f"p{k}": _instance() for k in range(3)}, policy.choose)
    assert policy.counts[Affinity.OVERRIDDEN] > 0 and policy.counts[Affinity.FOLLOWED] > 0
    assert all(chosen <= least + 1 for chosen, least in placements)
