"""What one decode step costs outside the model, at batch 256 with long contexts.

Measures the per-step pieces this engine runs besides the layers' math -- attention
``prepare``, batched sampling, detokenizing one token per request -- each next to the
way it was done before (metadata rebuilt in every layer, a sampling loop with one host
sync per row, a full re-decode of every output per token), on a 7B-shaped vocabulary
and page count. The model's forward is not run: on this CPU-only host a 7B-shaped layer
at batch 256 takes seconds and would say nothing about a GPU's step; the absolute
milliseconds here are the overhead a GPU step would carry.

Run: ``python -m epd_engine.bench.step_overhead --model models/tiny-llava --out FILE``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

from epd_engine.bench.results_file import write_results
from epd_engine.engine.detokenizer import Detokenizer
from epd_engine.model.attention import AttentionBatch
from epd_engine.model.attention_torch import TorchPagedAttention
from epd_engine.model.input_buffers import DecodeBuffers
from epd_engine.sampling import SamplingParams, SamplingRow, SamplingSpec
from epd_engine.worker.sampler import Sampler


def best_ms(run: Callable[[], object], repeats: int = 5) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best * 1000


def spread_ms(run: Callable[[], object], repeats: int = 7) -> dict[str, float]:
    """min / median / max of ``repeats`` timed runs after one warm-up, in ms."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1000)
    times.sort()
    return {"min": times[0], "median": times[len(times) // 2], "max": times[-1]}


def _old_sample(logits: torch.Tensor, params: list[SamplingParams]) -> list[int]:
    """The loop this engine replaced: per row, an argmax or a full sort, one sync each."""
    tokens = []
    for row, p in zip(logits, params, strict=True):
        if p.greedy:
            tokens.append(int(torch.argmax(row)))
            continue
        probs = torch.softmax(row / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < p.top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        tokens.append(int(torch.multinomial(probs, 1)))
    return tokens


def run(model_dir: Path, batch: int, pages: int, layers: int, vocab: int, output_len: int):
    from transformers import AutoTokenizer

    block_size = 16
    rng = random.Random(0)
    tables = [list(range(i * pages, (i + 1) * pages)) for i in range(batch)]
    contexts = [pages * block_size - rng.randrange(block_size) for _ in range(batch)]
    attention_batch = AttentionBatch([1] * batch, contexts, tables, block_size)
    backend = TorchPagedAttention()
    cpu = torch.device("cpu")
    prepare_ms = best_ms(lambda: backend.prepare(attention_batch, cpu))
    buffers = DecodeBuffers(batch, pages, block_size, cpu)
    new_tokens = list(range(batch))

    def buffered_prepare() -> None:
        backend.prepare_decode(buffers, buffers.fill(new_tokens, contexts, tables))

    prepare_spread = {
        "fresh_tensors": spread_ms(lambda: backend.prepare(attention_batch, cpu)),
        "persistent_buffers": spread_ms(buffered_prepare),
    }

    logits = torch.randn(batch, vocab) * 4  # peaked like an LM's, not flat noise
    greedy = SamplingParams(temperature=0.0)
    mixed = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=i) if i % 2 else greedy
        for i in range(batch)
    ]
    sampler = Sampler(cpu)

    def rows(params: list[SamplingParams]) -> list[SamplingRow]:
        return [SamplingRow(SamplingSpec(p), 100) for p in params]

    greedy_rows, mixed_rows = rows([greedy] * batch), rows(mixed)
    sample = {
        "greedy_ms": best_ms(lambda: sampler(logits, greedy_rows)),  # greedy: no in-place change
        "greedy_old_loop_ms": best_ms(lambda: _old_sample(logits, [greedy] * batch)),
        # the greedy pass before: torch's argmax (CPU: slower than max's indices)
        "greedy_torch_argmax_ms": best_ms(lambda: logits.argmax(dim=-1).tolist()),
        "half_top_p_seeded_ms": best_ms(lambda: sampler(logits.clone(), mixed_rows)),
        "half_top_p_old_loop_ms": best_ms(lambda: _old_sample(logits, mixed)),
    }

    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=True))

    text = "The image shows a red car parked next to a green tree. " * 200
    ids = tokenizer.encode(text, add_special_tokens=False)[:output_len]
    detoks = [Detokenizer(decode, ("###",)) for _ in range(batch)]
    for d in detoks:
        for token in ids[:-1]:
            d.add(token, final=False)

    def one_token_incremental() -> None:
        for d in detoks:
            d.add(ids[-1], final=False)
            d.token_ids.pop()  # keep the state the same between repeats
            d._read_offset = min(d._read_offset, len(d.token_ids))
            d._prefix_offset = min(d._prefix_offset, d._read_offset)

    def one_token_full_redecode() -> None:
        for _ in range(batch):
            decode(ids)

    detok = {
        "incremental_ms": best_ms(one_token_incremental, 3),
        "full_redecode_old_ms": best_ms(one_token_full_redecode, 3),
    }
    return {
        "batch": batch,
        "pages_per_sequence": pages,
        "block_size": block_size,
        "layers": layers,
        "vocab": vocab,
        "output_tokens": output_len,
        "torch_threads": torch.get_num_threads(),
        "attention_prepare_once_per_step_ms": prepare_ms,
        "attention_metadata_if_built_per_layer_ms": prepare_ms * layers,
        "decode_prepare_ms": prepare_spread,
        "sampling": sample,
        "detokenize_one_token_per_request": detok,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="checkpoint (its tokenizer)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--pages", type=int, default=128)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32064)
    parser.add_argument("--output-tokens", type=int, default=1000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = run(args.model, args.batch, args.pages, args.layers, args.vocab, args.output_tokens)
    print(json.dumps(result, indent=2))
    if args.out:
        write_results(args.out, result)


if __name__ == "__main__":
    main()
