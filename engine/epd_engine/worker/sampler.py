"""Batched sampling: one pass over the whole step's logits, one device-to-host copy.

Per row: EOS masked until ``min_tokens`` are out, temperature, top-k and top-p cuts, then
either argmax (greedy) or an inverse-CDF draw with one uniform number per row. A seeded
request's number comes from a generator
seeded with ``(seed, position)``, so its tokens depend only on its seed and where it is in
its sequence: not on what else is in the batch, nor on which instance samples it.
"""

from __future__ import annotations

import torch

from epd_engine.sampling import (
    SampledToken,
    SamplingParams,
    SamplingRow,
    TokenLogprobs,
)
from epd_engine.worker.device_copy import to_device
from epd_engine.worker.sampled_batch import SampledBatch

_MASK64 = (1 << 63) - 1
_CANDIDATES = 1024  # largest logits a top-k / top-p cut looks at before sorting a whole row


def _argmax(logits: torch.Tensor) -> torch.Tensor:  # [S, V] -> [S] int64
    """``argmax(dim=-1)``, the same index (the first maximum), 2.3x faster on CPU: torch's
    CPU ``argmax`` is slower than ``max``'s indices (26 vs 11 ms at 256 x 32,064)."""
    return logits.max(dim=-1).indices


def seed_for(seed: int, position: int) -> int:
    """A generator seed per (request seed, position): splitmix64's mixing step."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK64


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._noise = torch.Generator(device=device)  # unseeded rows share one stream
        self._noise.manual_seed(torch.seed())
        self._seeded = torch.Generator(device=device)  # re-seeded per seeded row

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
        """``logits`` ``[S, V]`` float32 (changed in place), one row per entry of ``rows``."""
        return self.launch(logits, rows).result()

    def launch(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampledBatch:
        """``__call__`` without waiting: the draws stay on the device, on their way to the
        host, until ``result()`` (rows asking for logprobs are read back at once)."""
        if not rows:
            return SampledBatch.ready([])
        params = [row.spec.params for row in rows]
        self._mask_eos_before_min_tokens(logits, rows)
        want_logprobs = any(p.logprobs for p in params)
        if all(p.greedy for p in params) and not want_logprobs:
            return SampledBatch.copying(_argmax(logits))
        temperatures = [1.0 if p.greedy else p.temperature for p in params]
        if any(t != 1.0 for t in temperatures):
            logits.div_(to_device(temperatures, torch.float32, logits.device)[:, None])
        self._truncate(logits, params)
        tokens = self._draw(logits, rows)  # [S] int64
        if not want_logprobs:
            return SampledBatch.copying(tokens)
        return SampledBatch.ready(self._with_logprobs(logits, tokens, params), tokens)

    @staticmethod
    def _mask_eos_before_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        for i, row in enumerate(rows):
            if row.num_output_tokens < row.spec.params.min_tokens:
                banned_rows.extend([i] * len(row.spec.eos_token_ids))
                banned_ids.extend(row.spec.eos_token_ids)
        if banned_rows:
            index = to_device([banned_rows, banned_ids], torch.long, logits.device)
            # The value as a device tensor: ``logits[i, j] = -inf`` copies a host scalar to
            # the GPU, which waits for the step in flight (seen on an H200 with sync debug).
            banned = torch.full((len(banned_rows),), float("-inf"), device=logits.device)
            logits.index_put_((index[0], index[1]), banned)

    @staticmethod
    def _truncate(
        logits: torch.Tensor, params: list[SamplingParams], sort_rows: bool | None = None
    ) -> None:
        """Set logits outside each row's top-k / top-p set to -inf (rows that ask only).

        On a CPU a full-vocabulary sort is slow (most of a step at batch 256), so the
        candidates are the ``_CANDIDATES`` largest logits first; only rows whose top-k /
        top-p set reaches beyond them (flat distributions) pay for the sort. Finding those
        rows reads one flag per row back. On a GPU that read-back would make the host wait
        for the step (and an async launch for the step in flight), while sorting every row
        on the device costs a fraction of a step: ``sort_rows`` (default: on a GPU) sorts
        them all and reads nothing back.
        """
        rows = [i for i, p in enumerate(params) if not p.greedy and (p.top_k or p.top_p < 1.0)]
        if not rows:
            return
        vocab = logits.shape[1]
        device = logits.device
        row_index = to_device(rows, torch.long, device)
        sub = logits[row_index]  # [R, V]
        top_k = to_device([params[i].top_k or vocab for i in rows], torch.long, device)
        top_p = to_device([params[i].top_p for i in rows], torch.float32, device)
        norm = sub.logsumexp(dim=-1, keepdim=True)
        if sort_rows is None:
            sort_rows = logits.is_cuda
        width = vocab if sort_rows else min(_CANDIDATES, vocab)
        values, order = sub.topk(width, dim=-1)  # [R, width], largest first
        keep, inside = _nucleus(values, norm, top_k, top_p, vocab)
        cut = _cut(sub, values, order, keep)
        outside = (~inside).nonzero().flatten().tolist() if width < vocab else []
        if outside:  # the set reaches past the candidates: sort those rows in full
            values, order = sub[outside].sort(dim=-1, descending=True)
            keep, _ = _nucleus(values, norm[outside], top_k[outside], top_p[outside], vocab)
            cut[outside] = _cut(sub[outside], values, order, keep)
        logits[row_index] = cut

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Inverse-CDF draws: one uniform number per row (not one per vocabulary entry)."""
        tokens = _argmax(logits)  # [S]
        random_rows = [i for i, row in enumerate(rows) if not row.spec.params.greedy]
        if not random_rows:
            return tokens
        every_row = len(random_rows) == len(rows)  # then no index copy at all
        random_index = None if every_row else to_device(random_rows, torch.long, self.device)
        probs = (logits if random_index is None else logits[random_index]).softmax(dim=-1)
        cdf = probs.cumsum_(dim=-1)
        uniform = torch.rand(len(random_rows), 1, generator=self._noise, device=self.device)
        for r, i in enumerate(random_rows):
            seed = rows[i].spec.params.seed
            if seed is not None:
                self._seeded.manual_seed(seed_for(seed, rows[i].position))
                uniform[r] = torch.rand(1, generator=self._seeded, device=self.device)
        # 1 - u is in (0, 1]: the first entry whose CDF reaches it has a non-zero probability
        target = (1.0 - uniform) * cdf[:, -1:]
        drawn = torch.searchsorted(cdf, target).clamp_(max=cdf.shape[1] - 1)[:, 0]
        if random_index is None:
            return drawn
        tokens[random_index] = drawn
        return tokens

    @staticmethod
    def _with_logprobs(
        logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]
    ) -> list[SampledToken]:
        logprobs = logits.log_softmax(dim=-1)  # [S, V]
        chosen = logprobs.gather(1, tokens[:, None])  # [S, 1]
        width = max(p.top_logprobs for p in params)
        columns = [tokens[:, None].double(), chosen.double()]
        if width:
            top_values, top_ids = logprobs.topk(width, dim=-1)  # [S, k]
            columns += [top_ids.double(), top_values.double()]
        table = torch.cat(columns, dim=1).tolist()  # the step's one device-to-host copy
        out = []
        for p, line in zip(params, table, strict=True):
            token = int(line[0])
            if not p.logprobs:
                out.append(SampledToken(token))
                continue
            ids, values = line[2 : 2 + width], line[2 + width :]
            top = tuple((int(ids[j]), values[j]) for j in range(p.top_logprobs))
            out.append(SampledToken(token, TokenLogprobs(line[1], top)))
        return out


def _cut(
    rows: torch.Tensor, values: torch.Tensor, order: torch.Tensor, keep: torch.Tensor
) -> torch.Tensor:
    """``rows`` [R, V] with -inf everywhere but the kept ``values`` (at their ``order``)."""
    return torch.full_like(rows, float("-inf")).scatter_(
        1, order, values.masked_fill(~keep, float("-inf"))
    )


def _nucleus(
    values: torch.Tensor,  # [R, W] logits, largest first (W <= V)
    logsumexp: torch.Tensor,  # [R, 1] over the whole row
    top_k: torch.Tensor,  # [R] (V when off)
    top_p: torch.Tensor,  # [R]
    vocab: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of ``values`` are in the top-k then top-p set, and whether that set is known
    to lie within them (``inside``): top-k within the width, or top-k off and the width's
    mass already reaching top-p."""
    width = values.shape[1]
    keep = torch.arange(width, device=values.device)[None, :] < top_k[:, None]
    masked = values.masked_fill(~keep, float("-inf"))
    k_inside = top_k <= width
    # renormalise over the top-k set: within the width when it fits, else the whole row
    norm = torch.where(k_inside[:, None], masked.logsumexp(dim=-1, keepdim=True), logsumexp)
    probs = (masked - norm).exp()
    mass_before = probs.cumsum(dim=-1) - probs
    keep &= mass_before < top_p[:, None]
    inside = k_inside | ((top_k >= vocab) & (probs.sum(dim=-1) >= top_p))
    return keep, inside
