"""Calibrate a cost model's overheads from one measured run of the live system.

``profile-costs`` times the runner alone; a live instance also runs its engine loop, the
router, HTTP, image decoding, token streaming and the migration protocol, and on a shared
host waits for the CPU. From a ``epdctl bench`` report whose requests carry per-stage seconds
(``stage_s``, reported by our servers, engine rules: a stage's queue starts when it becomes
next on an instance, for a migrated request when the target queued the offer, so a
``prefill_queue`` / ``decode_queue`` after a migration includes its pull) this estimates:

- ``pull_s``: the router's ``migration_image`` seconds (the target's pull, from its
  scheduling to the bytes in its pages) minus the bytes over the link;
- ``kv_pull_s``: a KV hop's ``decode_queue`` minus the bytes over the link. KV is offered
  early and the target waits on the source's prefill (long-polls, the last layer group after
  the first token), so its pull is that whole wait; ``migration_kv`` times only the last copy
  (0.03 ms of a 4 ms queue on 2 cores). At the lowest rate the decode instance is idle, so
  the queue is the pull;
- ``handoff_s``: the offer, from the source's last step to the target's queue. Not reported
  directly, but a KV hop sits inside the client's first inter-token gap: the first token
  leaves the prefill instance as the offer goes out, the second comes after the target's
  queue (``decode_queue``) and one decode step, so hand-off = gap - queue - step;
- ``request_s``: TTFT minus the time in stages and stage queues before the first token,
  minus the image offers before it (router + HTTP + preprocessing, and the first token's way
  back). Where the router measured the hops (``hop_image``: the encoder's end to the prefill
  instance's queue, from both processes' monotonic marks on one host, ``router.inflight``),
  each request's own is taken off and ``image_handoff_s`` is their distribution; in older
  reports an image offer is not observable apart from the front, and it is priced as the
  image pull's protocol latency (one exchange between the same two processes), not as the
  KV hop's ``handoff_s``, which is no offer alone (below);
- with measured ``hop_kv`` (prefill end to the decode instance's queue; negative when the
  early offer came before the prefill ended), ``kv_pull_s`` is only the part of the decode
  queue after the prefill ended (the rest of the first gap stays in ``handoff_s``: the offer,
  and the decode instance's relay of its first token, which no mark times);
- ``step_s``: measured decode seconds per generated token minus the model's decode step;
- ``encode_s`` / ``export_s``: the ``encode`` stage, and the ``prefill`` stage of a request
  whose KV migrates next (its prefill ran where nothing decodes), minus the runner's step for
  that work and ``step_s``: what those iterations do beyond it (one iteration each: a prompt
  within the token budget);
- ``silent_tokens``: the fraction of tokens after the first the client got no chunk for
  (server-counted tokens minus streamed chunks);
- empirical quantiles of each (the step's from every inter-token gap except one that spans
  a migration), which the simulator samples: on a shared host p90 TPOT is made of the
  jitter, which a median cannot reproduce. A gap is per chunk and spans the silent tokens
  before it; the simulator folds those itself, so the step's quantiles are unfolded to one
  token's (``unfold_silent``).

Migrations are only observable in a run that has them, so calibrate on a disaggregated
method (e.g. E+P+D: image and KV hops) and predict the others: the fidelity benchmark reports
errors on runs the calibration never saw. ``cpu_share`` is the calibration run's processes
per host core (``simulator.cpu_share``); the hand-off and pull overheads are stored
divided by it, the request and per-iteration overheads (stalls included) are not
(``Overheads``).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from statistics import median

from epd_engine.profiler.cost_model import BatchShape, FittedCostModel, Overheads
from epd_engine.profiler.front_contention import front_contention
from epd_engine.slo.outcomes import RequestResult

# Before the first token; prefill_queue already holds the image pull (see above).
_BEFORE_FIRST_TOKEN = ("encode_queue", "encode", "prefill_queue", "prefill")
_GAP_QUANTILES = 128
_MAX_POOLS = 3  # encode, prefill, decode: a longer path was re-routed after a failure


def quantiles(values: Sequence[float], num: int = 32) -> tuple[float, ...]:
    """``num`` evenly spaced empirical quantiles (midpoints), or () without data."""
    if not values:
        return ()
    ordered = sorted(values)
    picks = [
        ordered[min(len(ordered) - 1, int((i + 0.5) * len(ordered) / num))] for i in range(num)
    ]
    return tuple(round(x, 6) for x in picks)


def _hops_before_first_token(r: RequestResult, kv_hop: bool) -> int:
    """Migrations before the prefill that samples the first token (image hops)."""
    if r.path:
        return max(0, len(r.path) - 1 - int(kv_hop))
    return int("migration_image" in (r.stage_s or {}))


def unfold_silent(
    chunk: tuple[float, ...], silent: float, step_s: float, rounds: int = 30, num: int = 4096
) -> tuple[float, ...]:
    """Per-token overhead quantiles whose gaps, folded as the client sees them, have the
    quantiles ``chunk`` (the gaps' overheads over the model's step, as measured per chunk).

    The client measures one gap a chunk: after ``k - 1`` silent tokens a gap spans ``k``
    steps (``k - 1`` of them: the model's ``step_s`` and an overhead each). The simulator
    draws one overhead a token and folds silent tokens the same way (``tracker``), so drawing
    the per-chunk overheads folded them twice: simulated gaps 25% heavier than measured at
    p90-p98 (E+P+D on 2 cores, 14% silent). Deconvolved by fixed-point on the quantiles, with
    seeded draws (same data, same result)."""
    if not chunk or silent <= 0.0:
        return chunk
    rng = random.Random(0)
    n = len(chunk)
    samples = []  # (quantile indices of the k tokens' draws), common to every round
    for _ in range(num):
        picks = [rng.randrange(n)]
        while rng.random() < silent and len(picks) < 16:
            picks.append(rng.randrange(n))
        samples.append(picks)
    target = sorted(chunk)
    token = list(target)
    for _ in range(rounds):
        folded = [sum(token[i] for i in picks) + (len(picks) - 1) * step_s for picks in samples]
        for i, (want, got) in enumerate(zip(target, quantiles(folded, n), strict=True)):
            token[i] = max(0.0, token[i] + want - got)
        token.sort()
    return tuple(round(x, 6) for x in token)


def _median(values: Sequence[float]) -> float:
    return max(0.0, median(values)) if values else 0.0


def calibrate(
    cost: FittedCostModel,
    results: Sequence[RequestResult],
    source: str = "",
    cpu_share: float = 1.0,
) -> FittedCostModel:
    """``cost`` with ``overheads`` fitted to ``results`` (in the order they were sent); ValueError
    if they carry no stages."""
    if cpu_share < 1.0:
        raise ValueError(f"cpu_share must be >= 1, got {cpu_share}")
    measured = [r for r in results if r.ok and r.stage_s]
    if not measured:
        raise ValueError(
            "the run has no per-stage timings (stage_s); calibrate from our own router's bench"
        )
    # The first request sent pays one-off costs no other does (first kernels, connections:
    # 33 ms of encode vs 1.5, TTFT 118 ms vs 26 on 2 cores); drawn for 1 in 32 simulated
    # requests it set p90 TTFT. After a warm-up, dropping one more costs nothing.
    measured = measured[1:] or measured
    step_extra: list[float] = []
    model_steps: list[float] = []
    gap_extra: list[float] = []
    pull_extra: list[float] = []
    handoff: list[float] = []
    kv_pull: list[float] = []
    encode_extra: list[float] = []
    export_extra: list[float] = []
    before_first: list[tuple[float, int, float | None]] = []  # (TTFT outside stages, image
    # hops before it, their measured seconds when the router timed them)
    image_hops: list[float] = []  # measured hop_image
    kv_hops: list[float] = []  # measured hop_kv
    fronts: list[float] = []  # measured front and tail: what request_s holds
    routed: list[float] = []  # the front's part in the router (the rest is the instance's)
    tails: list[float] = []
    later_tokens = chunks = 0  # tokens after the first, and the chunks they came in
    rerouted = 0
    for r in measured:
        stages = r.stage_s or {}
        clean = not r.path or len(r.path) <= _MAX_POOLS
        rerouted += not clean
        kv_hop = "migration_kv" in stages
        kv_tokens = r.server_prompt_tokens or r.prompt_tokens
        image_tokens = r.num_images * (cost.capacity.tokens_per_image or 0)
        if "migration_image" in stages:
            link = cost.migration_s("image", image_tokens)
            pull_extra.append(max(0.0, stages["migration_image"] - link))
        measured_kv = stages.get("hop_kv") if kv_hop and clean else None
        if kv_hop and clean:
            link = cost.migration_s("kv", kv_tokens)
            queue = stages.get("decode_queue", 0.0)
            if measured_kv is not None:  # the queue before the prefill ended is no pull
                kv_hops.append(measured_kv)
                queue += min(0.0, measured_kv)
            kv_pull.append(max(0.0, queue - link))
        if r.num_images and "encode" in stages:
            encode = BatchShape(num_images=r.num_images, image_tokens=image_tokens)
            encode_extra.append(stages["encode"] - cost.runner_step_s(encode))
        if kv_hop and "prefill" in stages:
            prefill = BatchShape(
                num_tokens=kv_tokens,
                prefill_kpairs=kv_tokens * (kv_tokens + 1) / 2000,
                num_sampled=1,
            )
            export_extra.append(stages["prefill"] - cost.runner_step_s(prefill))
        tokens = max(r.num_output_tokens - 1, 0)
        later_tokens += tokens
        chunks += min(len(r.itl_s), tokens)
        if tokens > 0 and stages.get("decode"):
            context = r.prompt_tokens + r.num_output_tokens // 2
            model_step = cost.decode_s(1, context)
            per_token = stages["decode"] / tokens
            step_extra.append(per_token - model_step)
            model_steps.append(model_step)
            gaps = r.itl_s[1:] if kv_hop else r.itl_s  # the first gap spans the KV hop
            gap_extra += [max(0.0, gap - model_step) for gap in gaps]
            if kv_hop and r.itl_s and clean:
                queue = stages.get("decode_queue", 0.0) + min(0.0, measured_kv or 0.0)
                handoff.append(r.itl_s[0] - queue - per_token)
        if r.ttft_s is not None and clean:
            staged = sum(stages.get(key, 0.0) for key in _BEFORE_FIRST_TOKEN)
            hops = _hops_before_first_token(r, kv_hop)
            hop_s = stages.get("hop_image") if hops == 1 else None
            before_first.append((r.ttft_s - staged, hops, hop_s))
            if hop_s is not None:
                image_hops.append(hop_s)
            if "front" in stages:
                fronts.append(stages["front"])
            if "front_router" in stages:
                routed.append(stages["front_router"])
            if "tail" in stages:
                tails.append(stages["tail"])
    handoff_s = _median(handoff)
    # An image hop's offer: as the router measured it, else priced as its pull
    # (``Overheads.image_handoff_s``): the KV hop's hand-off, 4.7 ms on 2 cores, is its early
    # offer's race and D's relay, not an offer.
    image_offers = image_hops or pull_extra or handoff
    image_handoff_s = _median(image_offers)
    request_extra = [
        max(0.0, rest - (hops * image_handoff_s if hop_s is None else hop_s))
        for rest, hops, hop_s in before_first
    ]

    def per_share(values: Sequence[float]) -> list[float]:
        return [max(0.0, x) / cpu_share for x in values]

    # request_s and step_s are not per share: the router, HTTP and the entry instance's
    # preprocessing, and a decode gap's loop, relay and stalls, are the same in every plan
    # (Overheads).
    step_s = _median(step_extra)
    silent = 1.0 - chunks / later_tokens if later_tokens else 0.0
    gap_overheads = [max(0.0, x) for x in gap_extra]
    contention = front_contention(results)  # each request's decode competes, stages or not
    overheads = Overheads(
        request_s=_median(request_extra),
        step_s=step_s,
        handoff_s=handoff_s / cpu_share,
        pull_s=_median(pull_extra) / cpu_share,
        request_s_quantiles=quantiles([max(0.0, x) for x in request_extra]),
        # 128, not 32: ~17 gaps a request resolve the stall tail that sets p90 TPOT (p99 gap
        # 5.5 ms on 2 cores, beyond 32 quantiles' top at p98.4)
        step_s_quantiles=unfold_silent(
            quantiles(gap_overheads, _GAP_QUANTILES), silent, _median(model_steps)
        ),
        handoff_s_quantiles=quantiles(per_share(handoff)),
        pull_s_quantiles=quantiles(per_share(pull_extra)),
        image_handoff_s=image_handoff_s / cpu_share,
        image_handoff_s_quantiles=quantiles(per_share(image_offers)),
        kv_pull_s=_median(kv_pull) / cpu_share,
        kv_pull_s_quantiles=quantiles(per_share(kv_pull)),
        encode_s=max(0.0, _median(encode_extra) - step_s),
        export_s=max(0.0, _median(export_extra) - step_s),
        silent_tokens=silent,
        front_contention=contention or 0.0,
    )
    meta = dict(cost.meta)
    meta["calibration"] = {
        "source": source,
        "num_requests": len(measured),
        "num_rerouted_skipped": rerouted,
        "num_migrations": len(pull_extra) + len(kv_pull),
        "cpu_share": cpu_share,
        "request_s": overheads.request_s,
        "step_s": overheads.step_s,
        "handoff_s": overheads.handoff_s,
        "pull_s": overheads.pull_s,
        "kv_pull_s": overheads.kv_pull_s,
        "image_handoff_s": overheads.image_handoff_s,
        "encode_s": overheads.encode_s,
        "export_s": overheads.export_s,
        "silent_tokens": overheads.silent_tokens,
        "front_contention": contention,  # None: too few measured fronts overlapped a decode
        # measured by the router on one host (absent in older reports): medians, seconds
        "measured": {
            "num_image_hops": len(image_hops),
            "hop_image_s": _median(image_hops) if image_hops else None,
            "hop_kv_s": median(kv_hops) if kv_hops else None,
            "front_s": _median(fronts) if fronts else None,
            "front_router_s": _median(routed) if routed else None,
            "tail_s": _median(tails) if tails else None,
        },
    }
    return dataclasses.replace(cost, overheads=overheads, meta=meta)
