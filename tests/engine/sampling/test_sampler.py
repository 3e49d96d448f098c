"""The batched sampler: each rule on crafted logits, and seeded draws that ignore the batch."""

from __future__ import annotations

import math

import pytest
import torch

from epd_engine.sampling import SamplingParams, SamplingRow, SamplingSpec
from epd_engine.worker.sampler import Sampler

CPU = torch.device("cpu")
LOGITS = [2.0, 1.0, 0.5, 0.0, -1.0, -3.0]  # token 0 most likely, 5 least
EOS = 0


def rows(params: SamplingParams, count: int, position: int = 10, eos=frozenset()):
    spec = SamplingSpec(params, eos, num_prompt_tokens=position)
    return [SamplingRow(spec, position) for _ in range(count)]


def logits_for(count: int) -> torch.Tensor:
    return torch.tensor([LOGITS] * count)


def frequencies(tokens: list[int]) -> list[float]:
    return [tokens.count(t) / len(tokens) for t in range(len(LOGITS))]


def draw(params: SamplingParams, count: int = 20_000) -> list[int]:
    out = Sampler(CPU)(logits_for(count), rows(params, count))
    return [s.token_id for s in out]


def test_greedy_takes_the_argmax_of_every_row():
    logits = torch.tensor([LOGITS, LOGITS[::-1], [0.0, 0.0, 9.0, 0.0, 0.0, 0.0]])
    out = Sampler(CPU)(logits, rows(SamplingParams(temperature=0.0), 3))
    assert [s.token_id for s in out] == [0, 5, 2]


def test_greedy_breaks_ties_at_the_first_maximum_as_argmax_does():
    logits = torch.zeros(3, 40_000)  # long rows: vectorised max kernels work in blocks
    logits[0, [5, 39_000]] = 3.0
    logits[1, [31_999, 32_000]] = 3.0
    out = Sampler(CPU)(logits.clone(), rows(SamplingParams(temperature=0.0), 3))
    assert [s.token_id for s in out] == [5, 31_999, 0] == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_temperature_draws_follow_the_scaled_softmax(temperature):
    expected = torch.tensor(LOGITS).div(temperature).softmax(-1).tolist()
    seen = frequencies(draw(SamplingParams(temperature=temperature)))
    for got, want in zip(seen, expected, strict=True):
        assert abs(got - want) < 0.015, (seen, expected)


def test_top_k_keeps_only_the_k_most_likely_renormalised():
    seen = frequencies(draw(SamplingParams(top_k=2)))
    expected = torch.tensor(LOGITS[:2]).softmax(-1).tolist()
    assert seen[2:] == [0.0] * 4
    assert abs(seen[0] - expected[0]) < 0.015


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor(LOGITS).softmax(-1).tolist()  # ~0.57, 0.21, 0.13, ...
    top_p = probs[0] + probs[1] + 0.01  # 0 and 1 fall short of p: token 2 is needed too
    seen = frequencies(draw(SamplingParams(top_p=top_p)))
    assert seen[3:] == [0.0] * 3
    assert all(f > 0 for f in seen[:3])


def test_top_k_and_top_p_together_apply_top_p_within_the_top_k():
    seen = frequencies(draw(SamplingParams(top_k=3, top_p=0.5)))
    assert seen[0] == 1.0  # token 0 holds > 0.5 of the top-3 mass alone


def test_a_seeded_request_draws_the_same_tokens_whatever_else_is_in_the_batch():
    seeded = SamplingParams(temperature=1.0, seed=1234)
    spec = SamplingSpec(seeded, num_prompt_tokens=3)
    noise_spec = SamplingSpec(SamplingParams(temperature=1.3))
    greedy_spec = SamplingSpec(SamplingParams(temperature=0.0))
    flat = torch.zeros(1, 50)  # uniform: every token equally likely, so draws reveal noise
    alone, crowded = [], []
    for position in range(3, 40):
        sampler = Sampler(CPU)
        alone.append(sampler(flat.clone(), [SamplingRow(spec, position)])[0].token_id)
        batch = [SamplingRow(noise_spec, 7), SamplingRow(greedy_spec, 9)]
        batch.insert(position % 3, SamplingRow(spec, position))
        out = Sampler(CPU)(flat.repeat(3, 1), batch)
        crowded.append(out[position % 3].token_id)
    assert alone == crowded
    assert len(set(alone)) > 10  # the draws do vary with the position


def test_different_seeds_give_different_sequences():
    flat = torch.zeros(1, 1000)

    def sequence(seed: int) -> list[int]:
        spec = SamplingSpec(SamplingParams(seed=seed))
        return [Sampler(CPU)(flat.clone(), [SamplingRow(spec, p)])[0].token_id for p in range(8)]

    assert sequence(1) == sequence(1)
    assert sequence(1) != sequence(2)


def test_min_tokens_masks_eos_until_enough_tokens_are_out():
    """EOS has by far the highest logit; it cannot be drawn before min_tokens."""
    params = SamplingParams(temperature=0.0, min_tokens=3, max_tokens=8)
    spec = SamplingSpec(params, frozenset({EOS}), num_prompt_tokens=5)
    logits = torch.tensor([[50.0, 1.0, 0.0]] * 4)
    out = Sampler(CPU)(logits, [SamplingRow(spec, 5 + n) for n in range(4)])  # 0..3 out
    assert [s.token_id for s in out] == [1, 1, 1, EOS]


def test_logprobs_are_those_of_the_processed_distribution_with_the_top_alternatives():
    params = SamplingParams(temperature=0.5, top_k=3, logprobs=True, top_logprobs=2)
    out = Sampler(CPU)(logits_for(200), rows(params, 200))
    processed = torch.tensor(LOGITS[:3]).div(0.5).log_softmax(-1).tolist()
    for sampled in out:
        assert sampled.logprobs is not None
        assert sampled.token_id in (0, 1, 2)
        assert math.isclose(sampled.logprobs.logprob, processed[sampled.token_id], abs_tol=1e-5)
        (id0, lp0), (id1, lp1) = sampled.logprobs.top
        assert (id0, id1) == (0, 1)
        assert math.isclose(lp0, processed[0], abs_tol=1e-5)
        assert math.isclose(lp1, processed[1], abs_tol=1e-5)


def test_only_requests_that_ask_get_logprobs_and_top_logprobs_may_be_zero():
    asks = SamplingSpec(SamplingParams(temperature=0.0, logprobs=True))
    quiet = SamplingSpec(SamplingParams(temperature=0.0))
    out = Sampler(CPU)(logits_for(2), [SamplingRow(asks, 1), SamplingRow(quiet, 1)])
    assert out[0].logprobs is not None and out[0].logprobs.top == ()
    expected = torch.tensor(LOGITS).log_softmax(-1)[0].item()
    assert math.isclose(out[0].logprobs.logprob, expected, abs_tol=1e-5)
    assert out[1].logprobs is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"top_k": -1}, "top_k"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "needs logprobs"),
    ],
)
def test_bad_sampling_parameters_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_one_step_of_mixed_requests_synchronises_the_gpu_once():
    device = torch.device("cuda")
    specs = [
        SamplingSpec(SamplingParams(temperature=0.0)),
        SamplingSpec(SamplingParams(temperature=0.8, top_p=0.9, seed=3)),
        SamplingSpec(SamplingParams(top_k=5, logprobs=True, top_logprobs=3)),
        SamplingSpec(SamplingParams(min_tokens=4), frozenset({EOS}), num_prompt_tokens=2),
    ]
    sampler = Sampler(device)
    logits = torch.randn(len(specs), 32_000, device=device)
    batch = [SamplingRow(spec, 2) for spec in specs]
    sampler(logits.clone(), batch)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with pytest.warns(UserWarning) as caught:
            sampler(logits.clone(), batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]


def reference_cut(row: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """The top-k then top-p set by a full sort, written out plainly."""
    order = row.argsort(descending=True).tolist()[: top_k or len(row)]
    probs = row[order].softmax(-1).tolist()
    kept, mass = set(), 0.0
    for token, p in zip(order, probs, strict=True):
        if mass >= top_p:
            break
        kept.add(token)
        mass += p
    return kept


@pytest.mark.parametrize(
    ("top_k", "top_p", "spread"),
    [
        (0, 0.9, 0.1),  # flat: the nucleus reaches past the first candidates (full sort)
        (0, 0.9, 8.0),  # peaked: the candidates hold it
        (2000, 0.95, 0.1),  # top-k wider than the candidates
        (50, 0.8, 0.1),
        (50, 1.0, 0.1),
    ],
)
@pytest.mark.parametrize("sort_rows", [False, True], ids=["candidates", "sorted-on-device"])
def test_top_k_top_p_sets_equal_a_full_sort_on_a_large_vocabulary(top_k, top_p, spread, sort_rows):
    """Both paths: the CPU's candidates first, and the GPU's sort of every row (no flag read
    back), here forced on a CPU tensor."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 5000, generator=gen) * spread
    params = [SamplingParams(top_k=top_k, top_p=top_p)] * 3
    cut = logits.clone()
    Sampler._truncate(cut, params, sort_rows=sort_rows)
    for row in range(3):
        kept = set(torch.isfinite(cut[row]).nonzero().flatten().tolist())
        assert kept == reference_cut(logits[row], top_k, top_p)
        assert torch.equal(cut[row][list(kept)], logits[row][list(kept)])
