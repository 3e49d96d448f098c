"""The simulator models the prefix cache from a trace's shared-prefix blocks (``hash_ids``)
with each instance's KV capacity (issue 33 item 4), instead of replaying recorded hits: a
pool that holds every conversation finds each turn's earlier blocks, a smaller one evicts
them and computes them again, and routing by affinity keeps a conversation's turns on the
instance holding its pages. The plan search's bound counts the best case of those hits, so
it stays above what the simulation finds."""

from __future__ import annotations

import dataclasses

import pytest

from epd_engine.config import SLO, Method, Role, Stage
from epd_engine.contracts.plan import Budgets, Plan
from epd_engine.contracts.trace import TraceRecord
from epd_engine.profiler.bounds import stage_work
from epd_engine.profiler.cost_model import FittedCostModel
from epd_engine.profiler.sim_prefix import HASH_BLOCK_TOKENS, best_case_hits
from epd_engine.profiler.simulator import SimResult, simulate

from .factories import make_trace, toy_cost_model

SLO_LOOSE = SLO(ttft_s=60.0, tpot_s=10.0)
SESSIONS, TURNS, OWN = 8, 4, 100  # each turn: its blocks, then OWN tokens of its own
EPD = Role.EPD.value


def _conversations(with_blocks: bool = True) -> list[TraceRecord]:
    """Turn t of a session resends its t - 1 earlier blocks and adds one; turns come round by
    round (every session's turn 1, then every turn 2, ...), 1 s apart."""
    records: list[TraceRecord] = []
    for turn in range(1, TURNS + 1):
        for session in range(SESSIONS):
            blocks = tuple(1000 * session + k for k in range(turn))
            records.append(
                TraceRecord(
                    request_id=f"s{session}t{turn}",
                    arrival_s=float(len(records)),
                    prompt_tokens=turn * HASH_BLOCK_TOKENS + OWN,
                    output_tokens=4,
                    hash_ids=blocks if with_blocks else None,
                    session_id=f"s{session}",
                    # whole prompts with ids over them (no images: blocks from token 0)
                    hash_block_tokens=HASH_BLOCK_TOKENS,
                )
            )
    return records


def _cost(num_kv_blocks: int) -> FittedCostModel:
    cost = toy_cost_model(prefill_per_token_s=1e-5)
    return dataclasses.replace(
        cost, capacity=dataclasses.replace(cost.capacity, num_kv_blocks=num_kv_blocks)
    )


def _run(instances: int, num_kv_blocks: int, with_blocks: bool = True) -> SimResult:
    plan = Plan(method=Method.EPD, pools={Role.EPD: instances})
    result = simulate(plan, _conversations(with_blocks), _cost(num_kv_blocks), SLO_LOOSE)
    assert all(r.ok for r in result.results), [r.error for r in result.results if not r.ok]
    return result


# every turn after the first finds all the blocks of the one before
EVERY_EARLIER_BLOCK = SESSIONS * HASH_BLOCK_TOKENS * sum(range(TURNS))
# and its own tokens and answer (sim_turns.py): 100 + 3 written, six full 16-token pages
EVERY_EARLIER_TURN = EVERY_EARLIER_BLOCK + SESSIONS * (TURNS - 1) * 96
QUERIED = SESSIONS * sum(t * HASH_BLOCK_TOKENS + OWN for t in range(1, TURNS + 1))


def test_a_pool_holding_every_conversation_finds_each_turns_earlier_blocks() -> None:
    result = _run(instances=1, num_kv_blocks=2048)  # 32,768 tokens: all 8 sessions fit
    assert result.prefix_queried_tokens == {EPD: QUERIED}
    assert result.prefix_hit_tokens == {EPD: EVERY_EARLIER_TURN}


def test_a_smaller_pool_holds_fewer_prefixes_and_computes_them_again() -> None:
    """160 pages hold one session's last turn (4 blocks = 128 pages): round by round, the
    other sessions' turns evict a session's pages before its next turn comes."""
    large = _run(instances=1, num_kv_blocks=2048)
    small = _run(instances=1, num_kv_blocks=160)
    uncached = _run(instances=1, num_kv_blocks=2048, with_blocks=False)
    small_rate, large_rate = small.prefix_hit_rate(EPD), large.prefix_hit_rate(EPD)
    assert small_rate is not None and large_rate is not None
    assert small_rate < 0.25 * large_rate
    assert uncached.prefix_hit_tokens == {}  # no blocks: nothing modelled, nothing replayed
    # prefill work follows: the large pool computes the fewest tokens, the small about all
    busy = {name: r.busy_s_by_role[EPD] for name, r in [("large", large), ("small", small)]}
    busy["uncached"] = uncached.busy_s_by_role[EPD]
    assert busy["large"] < busy["small"] <= busy["uncached"] * 1.001


def test_affinity_keeps_each_conversation_on_the_instance_holding_it() -> None:
    """Three instances find what one would (each session's turns go to one of them)."""
    three = _run(instances=3, num_kv_blocks=2048)
    assert three.prefix_hit_tokens == {EPD: EVERY_EARLIER_TURN}


@pytest.mark.parametrize("method", [Method.E_P_D, Method.EP_D])
def test_decode_instances_pull_only_the_pages_they_lack(method: Method) -> None:
    """A conversation's later turn reaches the decode instance holding its earlier pages
    (affinity) and pulls only the rest, so its KV migration is shorter than cache-off's."""
    plan = Plan(method=method, pools=dict.fromkeys(method.roles, 1))
    cost = _cost(2048)
    modelled = simulate(plan, _conversations(), cost, SLO_LOOSE).results
    replayed = simulate(plan, _conversations(with_blocks=False), cost, SLO_LOOSE).results
    later = [i for i, r in enumerate(modelled) if not r.request_id.endswith("t1")]
    for i in later:
        moved, full = modelled[i].stage_s, replayed[i].stage_s
        assert moved is not None and full is not None
        assert moved["migration_kv"] < full["migration_kv"]


def test_the_best_case_is_what_an_unbounded_cache_finds_and_never_less_than_simulated() -> None:
    cost = _cost(2048)
    # the best case counts an earlier turn's written tokens, not only its full pages
    best = sum(best_case_hits(_conversations(), cost.image_tokens))
    assert best == EVERY_EARLIER_BLOCK + SESSIONS * (TURNS - 1) * (OWN + 3)
    # images and blocks shared in every mix: a page of a shared image hits too
    mixed = [
        record.model_copy(update={"hash_ids": (index % 3, index % 2)})
        for index, record in enumerate(make_trace(60, rate_rps=20, prompt_tokens=700,
                                                  shared_images=True, text_only_every=4))
    ]  # fmt: skip
    best = sum(best_case_hits(mixed, cost.image_tokens))
    for plan in (Plan(method=Method.EPD, pools={Role.EPD: 2}),
                 Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 2, Role.D: 1})):  # fmt: skip
        for pages in (64, 2048):
            result = simulate(plan, mixed, _cost(pages), SLO_LOOSE)
            found = max(result.prefix_hit_tokens.values())  # P's (or EPD's), not D's pulls
            assert found <= best, (plan.describe(), pages, found, best)
            assert found > 0 or pages == 64  # 64 pages hold about one request


def test_the_plan_search_bound_counts_prefill_net_of_the_best_case_hits() -> None:
    cost = _cost(2048)
    budgets = {stage: Budgets(image_budget=4, token_budget=512) for stage in Stage}
    shared = stage_work(_conversations(), cost, budgets)
    alone = stage_work(_conversations(with_blocks=False), cost, budgets)
    assert shared.prefill_s < 0.6 * alone.prefill_s  # 56 % of the prompt tokens hit
    assert shared.decode_s == alone.decode_s
    assert (shared.min_prefill_s <= alone.min_prefill_s).all()
