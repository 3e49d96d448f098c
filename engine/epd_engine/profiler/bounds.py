"""Per-stage work of a trace and the goodput bound the plan search prunes with.

``stage_work`` is the busy time one request needs per stage at the most efficient batch the
budgets and caches allow (fixed costs amortised over a full batch, attention and KV reads
counted exactly, encoder-cache hits free, prefix-cache hits at their best case
(``sim_prefix.best_case_hits``); each image at its trace tokens, and one larger than the image
budget alone in its batch, as the engine encodes it). HydraInfer's heuristic
partitions instances in proportion to it; the exhaustive search uses ``goodput_bound`` to
skip plans that cannot win:

- a pool of n instances with work w per request sustains at most n / w requests per second.
  Goodput is *defined* here as a sustainable rate: on a finite trace any plan passes at an
  absurd rate once the whole trace fits in one TTFT window (burst absorption), which no
  deployment can rely on, so the goodput search never goes above this capacity;
- a request whose unloaded latency already misses the SLO (encode + image migration +
  prefill alone > TTFT, or a batch-of-one decode step > TPOT) is a certain miss: if more
  than 10% are, the plan's goodput is 0 at any rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from epd_engine.config import SLO, Method, Role, Stage
from epd_engine.contracts.plan import Budgets
from epd_engine.contracts.trace import TraceRecord
from epd_engine.profiler.cost_model import FittedCostModel
from epd_engine.profiler.sim_prefix import best_case_hits
from epd_engine.profiler.sim_sessions import whole_prompts


@dataclass(frozen=True)
class StageWork:
    """Mean busy seconds per request of each stage on one instance, and latency floors."""

    encode_s: float
    prefill_s: float
    decode_s: float
    min_encode_s: np.ndarray  # [N] each request's images encoded alone
    min_migrate_s: np.ndarray  # [N] its image embeddings moved to another instance
    min_prefill_s: np.ndarray  # [N] its prompt prefilled alone, in budget-sized chunks
    min_tpot_s: np.ndarray  # [N] batch-of-one decode step at the request's final context
    max_output_tokens: int

    def min_ttft_s(self, method: Method) -> np.ndarray:
        """[N] unloaded TTFT under ``method`` (no migration when E and P share a pool)."""
        floor = self.min_encode_s + self.min_prefill_s
        if method.role_for(Stage.ENCODE) is not method.role_for(Stage.PREFILL):
            floor = floor + self.min_migrate_s
        return floor


def stage_work(
    records: Sequence[TraceRecord], cost: FittedCostModel, budgets: dict[Stage, Budgets]
) -> StageWork:
    """Work per request, given the budgets of the pools that run each stage."""
    cap = cost.capacity
    records = whole_prompts(records)  # a session's later turns prefill the conversation
    num = max(1, len(records))
    image_budget, token_budget = work_budgets(budgets)
    # the engine's image budget: ``image_budget`` pages of tokens (LLaVA-1.5: that many images)
    image_batch_tokens = image_budget * cap.image_block_tokens
    lm = cost.language
    pf_per_token = (lm.fixed_s + lm.per_token_s * max(token_budget, lm.knee_tokens)) / token_budget
    kv_tokens = cap.num_kv_blocks * cap.kv_block_size

    seen: set[str] = set()
    hits = best_case_hits(records, cost.image_tokens)
    encode = prefill = decode = 0.0
    floors = np.zeros((4, len(records)))  # encode, migrate, prefill, tpot
    for i, record in enumerate(records):
        image_tokens = [cost.image_tokens(image.tokens) for image in record.images]
        for image, t in zip(record.images, image_tokens, strict=True):
            if image.hash not in seen:  # encoder-cache hits cost nothing (optimistic)
                encode += t * _encode_per_token(cost, max(t, image_batch_tokens))
        seen.update(image.hash for image in record.images)
        prompt = record.prompt_tokens + sum(image_tokens)
        hit = max(0, min(hits[i], prompt - 1))  # computed: positions hit .. prompt - 1
        computed = prompt - hit
        prefill += (
            computed * pf_per_token
            + lm.per_kpair_s * (prompt * (prompt + 1) - hit * (hit + 1)) / 2000.0
            + lm.per_sample_s
        )
        steps = record.output_tokens - 1
        final_context = prompt + record.output_tokens
        batch = max(1, min(cap.max_num_running, kv_tokens // max(1, final_context)))
        per_step = (lm.fixed_s + lm.per_token_s * max(batch, lm.knee_tokens)) / batch
        context_k = steps * (prompt + (record.output_tokens + 1) / 2) / 1000.0
        decode += steps * (per_step + lm.per_sample_s) + lm.per_kcontext_s * context_k
        chunks = -(-computed // token_budget)
        floors[2, i] = sum(
            cost.prefill_s(min(token_budget, computed - k * token_budget)) for k in range(chunks)
        )
        if image_tokens:
            floors[0, i] = cost.encode_s(sum(image_tokens))
            floors[1, i] = cost.migration_s("image", sum(image_tokens))
        floors[3, i] = cost.decode_s(1, final_context) if steps > 0 else 0.0
    return StageWork(
        encode / num,
        prefill / num,
        decode / num,
        floors[0],
        floors[1],
        floors[2],
        floors[3],
        max_output_tokens=max((r.output_tokens for r in records), default=1),
    )


def compose(by_stage: dict[Stage, StageWork]) -> StageWork:
    """One ``StageWork`` from each stage's part of its own (pools of different
    tensor-parallel sizes: each stage costed at the size of the pool that runs it)."""
    encode, prefill, decode = (by_stage[s] for s in (Stage.ENCODE, Stage.PREFILL, Stage.DECODE))
    if encode is prefill is decode:
        return encode
    return StageWork(
        encode.encode_s,
        prefill.prefill_s,
        decode.decode_s,
        encode.min_encode_s,
        encode.min_migrate_s,
        prefill.min_prefill_s,
        decode.min_tpot_s,
        max_output_tokens=decode.max_output_tokens,
    )


def work_budgets(budgets: dict[Stage, Budgets]) -> tuple[int, int]:
    """All ``stage_work`` reads of the budgets: methods that agree on these share its result."""
    return budgets[Stage.ENCODE].image_budget, budgets[Stage.PREFILL].token_budget


def _encode_per_token(cost: FittedCostModel, batch_tokens: int) -> float:
    """Encode seconds per image token in the fullest batch an image can share: the budget's
    tokens, or the image alone when it is larger (images are encoded whole)."""
    return cost.encode_s(batch_tokens) / batch_tokens


def pool_work_s(method: Method, role: Role, work: StageWork, overlap: float) -> float:
    """Busy seconds per request of one instance of ``role`` (co-located stages share it)."""
    parts = [
        w
        for stage, w in (
            (Stage.ENCODE, work.encode_s),
            (Stage.PREFILL, work.prefill_s),
            (Stage.DECODE, work.decode_s),
        )
        if role.runs(stage)
    ]
    total = sum(parts)
    vision = work.encode_s if role.runs(Stage.ENCODE) else 0.0
    # A step costs e + l - overlap·min(e, l) >= (e + l)(1 - overlap/2), and >= max(e, l).
    return max(total * (1 - overlap / 2), vision, total - vision)


def goodput_bound(
    method: Method,
    pools: dict[Role, int],
    work: StageWork,
    slo: SLO,
    num_requests: int,
    overlap: float,
) -> float:
    """Upper bound on the plan's sustainable goodput (req/s); 0 when the SLO is out of reach."""
    return capacity_bound(pools, role_work_s(method, work, slo, num_requests, overlap))


def role_work_s(
    method: Method, work: StageWork, slo: SLO, num_requests: int, overlap: float
) -> dict[Role, float] | None:
    """Each pool's busy seconds per request under ``method`` (``pool_work_s``), or None when
    too many requests miss the SLO unloaded: the part of the bound every ratio shares."""
    allowed_misses = num_requests - int(np.ceil((slo.attainment - 1e-12) * num_requests))
    late = (work.min_ttft_s(method) > slo.ttft_s) | (work.min_tpot_s > slo.tpot_s)
    if int(np.sum(late)) > allowed_misses:
        return None
    return {role: pool_work_s(method, role, work, overlap) for role in method.roles}


def capacity_bound(pools: dict[Role, int], work_s: dict[Role, float] | None) -> float:
    """The fewest requests per second a pool of ``pools`` sustains, given ``role_work_s``."""
    if work_s is None:
        return 0.0
    return counts_bound(tuple(pools[r] for r in work_s), tuple(work_s.values()))


def counts_bound(counts: tuple[int, ...], work_s: tuple[float, ...]) -> float:
    """``capacity_bound`` with the pools' instance counts and work in the same order (the
    search bounds every candidate of a fleet: 33,151 at 256 GPUs, no dict each)."""
    bound = float("inf")
    for n, w in zip(counts, work_s, strict=True):
        if w > 0:
            bound = min(bound, n / w)
    return bound
