"""Cost model seam: iteration time of one instance as a function of its batch composition.

The fitted model (``FittedCostModel``) is compact and saved as JSON with the hardware, model and
software versions it was measured on (``epdctl profile-costs``). Shape of one iteration, as the
runner executes it (encode first, then one ragged language-model pass over prefill chunks and
decodes, then sampling)::

    encode_s = e_fixed + e_per_token * max(image_tokens, e_knee)        (only if images > 0)
    lm_s     = l_fixed + l_per_token * max(tokens, l_knee) + l_per_kpair * prefill_kpairs
               + l_per_kcontext * decode_kcontext + l_per_sample * sampled   (only if tokens > 0)
    step_s   = encode_s + lm_s - overlap * min(encode_s, lm_s)

The knees model saturation (HydraInfer: encode saturates near 6 images, decode near 512
tokens on an H800; below the knee a batch costs the same as at the knee). ``overlap`` is
the share of the shorter part hidden by dual streams when stages are co-located (0 on CPU).
Prefill attention is compute (query x key pairs); decode attention reads the KV cache (context
tokens), so they get separate coefficients.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from epd_engine.profiler.links import NETWORK_LINK, LinkCoeffs, link_backend
from epd_engine.profiler.rank_costs import RankCosts
from epd_engine.scheduler.output import SchedulerOutput

COST_MODEL_KIND = "epd-cost-model"
COST_MODEL_VERSION = 1


@dataclass(frozen=True, slots=True)
class BatchShape:
    """What one iteration costs depends on: counts only, no tensors."""

    num_images: int = 0
    image_tokens: int = 0
    num_tokens: int = 0  # prefill chunk tokens + one per decode
    prefill_kpairs: float = 0.0  # sum over prefill chunks of query x key token pairs / 1000
    decode_kcontext: float = 0.0  # sum over decodes of context tokens read / 1000
    num_sampled: int = 0

    @classmethod
    def of(cls, out: SchedulerOutput) -> BatchShape:
        tokens = 0
        pairs = 0.0
        sampled = 0
        for task in out.prefills:
            n = len(task.token_ids)
            tokens += n
            pairs += n * (task.start_position + (n + 1) / 2)  # causal: each query sees its prefix
            sampled += task.sample
        context = sum(task.start_position + 1 for task in out.decodes)
        return cls(
            num_images=len(out.encodes),
            image_tokens=sum(t.num_tokens for t in out.encodes),
            num_tokens=tokens + len(out.decodes),
            prefill_kpairs=pairs / 1000.0,
            decode_kcontext=context / 1000.0,
            num_sampled=sampled + len(out.decodes),
        )


class CostModel(Protocol):
    """Contract: ``step_s`` is the wall time of one iteration of that shape on one instance,
    > 0 for a non-empty batch, non-decreasing in every field; ``migration_s`` the time to move
    one request's image embeddings or KV between instances of different pools."""

    def step_s(self, shape: BatchShape) -> float: ...

    def migration_s(self, kind: str, num_tokens: int) -> float: ...


@dataclass(frozen=True)
class EncodeCoeffs:
    fixed_s: float = 0.0
    per_token_s: float = 0.0
    knee_tokens: float = 0.0

    def at(self, image_tokens: int) -> float:
        if image_tokens <= 0:
            return 0.0
        return self.fixed_s + self.per_token_s * max(image_tokens, self.knee_tokens)


@dataclass(frozen=True)
class LanguageCoeffs:
    fixed_s: float = 0.0
    per_token_s: float = 0.0
    knee_tokens: float = 0.0
    per_kpair_s: float = 0.0
    per_kcontext_s: float = 0.0
    per_sample_s: float = 0.0

    def at(
        self, num_tokens: int, prefill_kpairs: float, decode_kcontext: float, num_sampled: int
    ) -> float:
        if num_tokens <= 0:
            return 0.0
        return (
            self.fixed_s
            + self.per_token_s * max(num_tokens, self.knee_tokens)
            + self.per_kpair_s * prefill_kpairs
            + self.per_kcontext_s * decode_kcontext
            + self.per_sample_s * num_sampled
        )


@dataclass(frozen=True)
class MigrationCoeffs:
    """Pull-based transfer over the deployment's link: a fixed cost per transfer plus bytes
    over the link. An image moves in one transfer, KV in one per layer group."""

    latency_s: float = 0.002  # per transfer
    bytes_per_s: float = 1e9
    image_bytes_per_token: int = 0  # image-cache row (hidden x (1 + DeepStack levels)) x dtype
    kv_bytes_per_token: int = 0  # 2 x layers x kv_heads x head_dim x dtype bytes
    kv_transfers: int = 1  # layer groups per KV migration (ceil(layers / layers per group))
    # Sliding-window layers (Gemma 3): their bytes per token, moved for the last
    # ``kv_window_tokens`` tokens only (a pull leaves the pages behind the window out);
    # ``kv_bytes_per_token`` then counts the other (global) layers alone.
    kv_windowed_bytes_per_token: int = 0
    kv_window_tokens: int = 0
    # The engine's early hand-off: KV groups move while prefill runs, so only the last one is
    # left once it ends. (Assumes a group moves faster than the next group's layers compute;
    # a link slower than that would show more, which this model does not.)
    early_kv: bool = True

    def at(self, kind: str, num_tokens: int) -> float:
        """The migration's time on the request's path, after its source stage ended."""
        if kind == "image":
            return self.latency_s + num_tokens * self.image_bytes_per_token / self.bytes_per_s
        whole = self.kv_transfers * self.latency_s + self.kv_bytes(num_tokens) / self.bytes_per_s
        return whole / self.kv_transfers if self.early_kv else whole

    def kv_bytes(self, num_tokens: int) -> int:
        """Bytes a KV migration of ``num_tokens`` cached tokens moves."""
        windowed = min(num_tokens, self.kv_window_tokens) * self.kv_windowed_bytes_per_token
        return num_tokens * self.kv_bytes_per_token + windowed

    def over(self, link: LinkCoeffs) -> MigrationCoeffs:
        """The same bytes over another link."""
        return replace(self, latency_s=link.latency_s, bytes_per_s=link.bytes_per_s)


@dataclass(frozen=True)
class Capacity:
    """Cache sizes of one instance (what the engine is started with)."""

    num_kv_blocks: int = 512
    kv_block_size: int = 16
    num_image_blocks: int = 64
    image_block_tokens: int = 576  # one image per page (HydraInfer)
    max_num_running: int = 256
    max_model_len: int = 4096
    tokens_per_image: int | None = None  # fixed-resolution models (LLaVA-1.5): cost images at it


@dataclass(frozen=True)
class Overheads:
    """What a live system adds around the runner, calibrated from a measured run
    (``profiler.calibrate``): the router, HTTP and image preprocessing before a request reaches
    an instance, the engine loop (scheduling, detokenising, streaming) per iteration, and the
    migration protocol's own latency (DESIGN.md §4) on top of moving the bytes.

    A migration is ``handoff_s`` (step 1: the source offers, the target queues it), then, once
    the target's scheduler admits it, ``pull_s + migration.at(kind, tokens)`` (steps 2-3:
    ``pull_s`` the protocol around the pages -- ``kv_pull_s`` for KV when calibrated apart --
    ``migration`` the pages over the link).
    ``migration`` alone is the link of the deployment's transfer backend as ``profile-costs``
    measured it (``FittedCostModel.for_backend``), a floor the plan bounds use.

    On one shared host the migration protocol competes with every process of the deployment:
    ``handoff_s`` and ``pull_s`` are stored per unit of CPU share (``cpu_share``: processes
    per core, at least 1) and the simulator multiplies them by its plan's share. ``request_s``
    and ``step_s`` are stored as measured and not scaled: they are the router, HTTP and the
    entry instance's preprocessing, and a decode gap's engine loop and token relay -- the same
    processes in every plan, whose other instances are idle for most of a request. Measured
    on 2 cores, TTFT outside the stages is 15-18 ms in EPD (share 1), 18-19 in EP+D (1.5) and
    20-22 in E+P+D (2, an image hop included): scaled by the share, EPD's was half of it.
    So are a gap's stalls (its draws far above the median of ``step_s_quantiles``): over
    200 requests a rate, the measured gaps' p50 / p90 / p98 are 0.7 / 1.8-2.1 / 3.7-4.5 ms in
    E+P+D (share 2), EP+D (1.5) and EPD (1) alike, and do not grow from 1 to 4 req/s; a big
    gap is followed by a burst (57-74% of gaps > 3 ms by one < 0.3 ms): the token relay
    waiting, not a core. (Stored per share, from 40-request runs, EPD's were halved: p90 TPOT
    -23 to -35%.) Contention while other instances are busy is ``host_cores`` sharing.
    """

    request_s: float = 0.0  # arrival -> queued on its first instance
    step_s: float = 0.0  # added to every iteration (not per share, nor are its stalls)
    handoff_s: float = 0.0  # source's stage done -> queued on the migration target
    pull_s: float = 0.0  # pull protocol latency beyond bytes / bandwidth
    # Empirical quantiles of the same (a live host jitters: p90 TPOT is made of the spikes).
    # When present the simulator draws from them with a seeded RNG instead of the medians.
    request_s_quantiles: tuple[float, ...] = ()
    step_s_quantiles: tuple[float, ...] = ()
    handoff_s_quantiles: tuple[float, ...] = ()
    pull_s_quantiles: tuple[float, ...] = ()
    # A KV pull's, when calibrated apart (else pull_s): KV moves by the early hand-off, whose
    # target waits on the source's prefill (``calibrate``).
    kv_pull_s: float = 0.0
    kv_pull_s_quantiles: tuple[float, ...] = ()
    # An image hop's offer (step 1 after an encode), when calibrated apart (else handoff_s).
    # ``handoff_s`` is read off the KV hop, whose first gap also holds the early offer's race
    # with the prefill and the decode instance's token relay: 4.7 ms on 2 cores, while an
    # image offer is one exchange between the same two processes, like its pull. TTFT holds
    # the image offer only together with the request overhead, so ``calibrate`` prices it as
    # the image pull's protocol latency (``pull_s``); priced as the KV hop's, it took 4.7 ms
    # off ``request_s`` that EPD and EP+D, with no image hop, then lacked (issue 19).
    image_handoff_s: float = 0.0
    image_handoff_s_quantiles: tuple[float, ...] = ()
    # Iterations that cost more than the runner's timed work and ``step_s`` (not per share):
    # an encode, and a prefill on an instance that does not decode (it offers the KV early
    # and marks each written layer for the target's pull, DESIGN.md §4, while its event loop
    # answers the target's polls). Tiny-llava on 2 cores: 0.8 and 1.5 ms; EPD's prefill,
    # which exports nothing, is within 0.4 ms of the runner's.
    encode_s: float = 0.0
    export_s: float = 0.0
    # Fraction of tokens after the first that reach the client with no text (the server
    # holds it back): no gap of their own, their time folds into the next (``tracker``).
    # Tiny-llava: 14%, so a 12-token reply shows 9 gaps and its p90 gap is the KV hop.
    silent_tokens: float = 0.0
    # Shared host: seconds a request's front grows per second of iterations running on the
    # host while it runs (CPU contention; ``front_contention``). An iteration in the front's
    # own process also runs at half speed meanwhile (the GIL: in-front decode gaps in EPD
    # averaged 1.7-3.3 ms against 0.9-1.2 without), which needs no calibration (``simulator``).
    front_contention: float = 0.0


@dataclass(frozen=True)
class FittedCostModel:
    encode: EncodeCoeffs = field(default_factory=EncodeCoeffs)
    language: LanguageCoeffs = field(default_factory=LanguageCoeffs)
    overlap: float = 0.0
    migration: MigrationCoeffs = field(default_factory=MigrationCoeffs)
    capacity: Capacity = field(default_factory=Capacity)
    meta: dict[str, Any] = field(default_factory=dict)  # hardware, model, software, fit quality
    overheads: Overheads = field(default_factory=Overheads)
    # Each backend's link as measured on the profiled machine, and the one ``migration``
    # holds now ("" when unknown: the reference model, or files from before these were
    # measured, whose ``migration`` is a raw loopback socket).
    links: dict[str, LinkCoeffs] = field(default_factory=dict)
    transfer_backend: str = ""
    # Migrations between nodes, where their link differs from ``migration`` (the link between
    # instances on one node): the simulator charges each pair by where its instances run
    # (``placement.py``). None: one link for every pair.
    remote_migration: MigrationCoeffs | None = None
    # What splitting the language model over ranks costs and frees (``rank_costs.py``); the
    # plan search tries tensor-parallel sizes only with it. None: one rank per instance.
    ranks: RankCosts | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"overlap must be in [0, 1], got {self.overlap}")

    def encode_s(self, image_tokens: int) -> float:
        return self.encode.at(image_tokens)

    def step_s(self, shape: BatchShape) -> float:
        enc = self.encode.at(shape.image_tokens)
        lm = self.language.at(
            shape.num_tokens, shape.prefill_kpairs, shape.decode_kcontext, shape.num_sampled
        )
        return enc + lm - self.overlap * min(enc, lm) + self.overheads.step_s

    def runner_step_s(self, shape: BatchShape) -> float:
        """``step_s`` without the calibrated engine overhead (the simulator adds its own draw)."""
        return self.step_s(shape) - self.overheads.step_s

    def migration_s(self, kind: str, num_tokens: int, remote: bool = False) -> float:
        """``remote``: source and target on different nodes."""
        if remote and self.remote_migration is not None:
            return self.remote_migration.at(kind, num_tokens)
        return self.migration.at(kind, num_tokens)

    def across_nodes(self, link: LinkCoeffs | None) -> FittedCostModel:
        """This model with migrations between nodes over ``link`` (a NIC's latency and
        bandwidth; the stored ``links[NETWORK_LINK]`` when measured); None: as on one node."""
        remote = None if link is None else self.migration.over(link)
        return replace(self, remote_migration=remote)

    def for_backend(self, backend: str, same_host: bool = True) -> FittedCostModel:
        """This model with ``migration`` over the link a deployment configured with
        ``backend`` uses (``links.link_backend``). A backend that was not measured keeps the
        stored link: models from before per-backend links, the reference, ``cuda_ipc``."""
        name = link_backend(backend, same_host)
        link = self.links.get(name)
        if link is None:
            return self
        moved = replace(self, migration=self.migration.over(link), transfer_backend=name)
        return moved.across_nodes(self.links.get(NETWORK_LINK))

    def for_groups(self, backend: str) -> FittedCostModel:
        """Placement groups: ``migration`` over the in-pod link (one host: ``shm`` for
        ``auto``), ``remote_migration`` over the cross-pod one (``tcp``); the simulator
        charges each hand-off by whether its pair shares a group (``instance_groups``)."""
        inside = self.for_backend(backend, same_host=True)
        across = self.for_backend(backend, same_host=False)
        return replace(inside, remote_migration=across.migration)

    # ---- closed forms the budget search and the plan bounds use ---------------------------
    def prefill_s(self, num_tokens: int) -> float:
        """One fresh prompt chunk of ``num_tokens`` (the engine's budget probe)."""
        return self.language.at(num_tokens, num_tokens * (num_tokens + 1) / 2000.0, 0.0, 1)

    def decode_s(self, batch_size: int, context_tokens: int) -> float:
        """A decode-only batch, each request at ``context_tokens`` of context."""
        kcontext = batch_size * (context_tokens + 1) / 1000.0
        return self.language.at(batch_size, 0.0, kcontext, batch_size)

    def image_tokens(self, trace_tokens: int) -> int:
        return self.capacity.tokens_per_image or trace_tokens

    # ---- JSON -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"kind": COST_MODEL_KIND, "version": COST_MODEL_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<cost model>") -> FittedCostModel:
        if data.get("kind") != COST_MODEL_KIND:
            raise ValueError(f"{source}: not a cost model (kind is {data.get('kind')!r})")
        if data.get("version") != COST_MODEL_VERSION:
            raise ValueError(f"{source}: cost model version {data.get('version')} unsupported")
        try:
            return cls(
                encode=EncodeCoeffs(**data.get("encode", {})),
                language=LanguageCoeffs(**data.get("language", {})),
                overlap=float(data.get("overlap", 0.0)),
                migration=MigrationCoeffs(**data.get("migration", {})),
                capacity=Capacity(**data.get("capacity", {})),
                meta=dict(data.get("meta", {})),
                overheads=_overheads(data.get("overheads", {})),
                links={str(k): LinkCoeffs(**v) for k, v in data.get("links", {}).items()},
                transfer_backend=str(data.get("transfer_backend", "")),
                remote_migration=(
                    MigrationCoeffs(**data["remote_migration"])
                    if data.get("remote_migration")
                    else None
                ),
                ranks=RankCosts.from_dict(data["ranks"]) if data.get("ranks") else None,
            )
        except (TypeError, ValueError, KeyError) as exc:  # unknown, missing or impossible field
            raise ValueError(f"{source}: malformed cost model ({exc})") from exc


def _overheads(data: dict[str, Any]) -> Overheads:
    names = ("request_s", "step_s", "handoff_s", "pull_s", "kv_pull_s", "image_handoff_s")
    fixed = ("encode_s", "export_s", "silent_tokens", "front_contention")  # no quantiles
    known = {*names, *fixed, *(f"{n}_quantiles" for n in names)}
    if set(data) - known:
        raise TypeError(f"unknown overheads fields {sorted(set(data) - known)}")
    values: dict[str, Any] = {name: float(data.get(name, 0.0)) for name in fixed}
    for name in names:
        values[name] = float(data.get(name, 0.0))
        values[f"{name}_quantiles"] = tuple(float(x) for x in data.get(f"{name}_quantiles", ()))
    return Overheads(**values)


def save_cost_model(model: FittedCostModel, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(model.to_dict(), indent=2) + "\n", encoding="utf-8")
    return path


def config_fingerprint(model_dir: Path) -> str:
    """The checkpoint a cost model was profiled on, as its ``meta.model.config_sha256``:
    the start of its ``config.json``'s SHA-256 (OSError when there is none)."""
    return hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()[:16]


def load_cost_model(path: str | Path) -> FittedCostModel:
    """Read a cost model JSON; ValueError naming the file when it is not one."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read cost model ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a cost model (expected a JSON object)")
    return FittedCostModel.from_dict(data, source=str(path))
