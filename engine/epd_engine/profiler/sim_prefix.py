"""The prefix cache in the simulator, modelled from a trace's shared-prefix blocks.

A trace whose records carry ``hash_ids`` (Mooncake's: equal ids at the start of two prompts
mean an equal prefix, one id per ``HASH_BLOCK_TOKENS`` tokens) says which prompts share
what, not what the engine's caches served. The simulator then runs every instance with the
engine's own prefix cache (``KVCacheManager`` with page keys, ``match_for_prefill``,
registration, least-recently-used eviction) on prompts whose token ids carry those blocks:
block ``b``'s tokens are all ``hash_ids[b]``, so two prompts share a KV page exactly when
the blocks it covers are equal (a page's key also hashes its parent's, so equal blocks at
different positions do not meet). The rest of a prompt is its own. Hits then depend on each
instance's KV pages, its traffic and the routing -- a smaller pool holds fewer prefixes --
instead of being replayed from ``TraceRecord.cached_tokens``.

A prompt is laid out as ``epdctl bench`` sends a record: its images first, then its text
(the blocks, then its own tokens). So a request whose first image is its own shares no text
with others, as on the engine when bench replays it; a trace whose shared system prompt came
before a fresh image in the original traffic is undercounted. The router's live trace says
more (``hash_block_tokens`` set): its ids name blocks over the whole prompt, images
included, and its images carry their offsets, so such a prompt is laid out as the server
had it: the blocks from the first token, each image where it was.

A conversation's turn is written with its next turn's ids past its blocks, its answer too
(``sim_turns.py``), so the next turn finds the answer's pages as the engine's does. A
partial block of a record with no next turn is a miss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate

from epd_engine.contracts.trace import TraceRecord
from epd_engine.profiler.sim_turns import next_turns

HASH_BLOCK_TOKENS = 512  # Mooncake's block (``workload/trace_formats.py`` writes the same)
SIM_PREFIX_SALT = "simulated-model"  # one model per simulation: any fixed salt
_OWN_TOKEN = -1  # a prompt's tokens past its blocks, and image placeholders


def models_prefix_cache(records: Sequence[TraceRecord]) -> bool:
    """Whether a simulation of ``records`` models the prefix cache (any record says what
    it shares) rather than replaying the hits they recorded."""
    return any(record.hash_ids for record in records)


def image_offsets(record: TraceRecord, sizes: Sequence[int]) -> list[int]:
    """Where a record's images (of ``sizes`` tokens each, the cost model's) go in its
    simulated prompt: where the server had them when the trace says (shifted by any
    difference between the trace's tokens per image and ``sizes``), else all first."""
    if any(image.offset is None for image in record.images):
        return list(accumulate(sizes, initial=0))[:-1]
    growth = [size - image.tokens for image, size in zip(record.images, sizes, strict=True)]
    shifts = list(accumulate(growth, initial=0))[:-1]
    return [(image.offset or 0) + shift for image, shift in zip(record.images, shifts, strict=True)]


def blocks_cover_whole_prompt(record: TraceRecord) -> bool:
    """Whether the record's ids name blocks from its first token, images included (the
    router's live trace), rather than blocks of text after its images."""
    return record.hash_block_tokens is not None


def prompt_token_ids(
    record: TraceRecord, index: int, image_tokens: int, total: int, block_tokens: int
) -> tuple[list[int], int]:
    """``total`` token ids for request ``index``: images' placeholders (``image_tokens`` of
    them, first), then the record's blocks, then tokens no other request has; and where
    those begin. Blocks over the whole prompt start at its first token instead, at the
    record's own block size."""
    own = _OWN_TOKEN - 1 - index  # negative: never a block id (Mooncake's are >= 0)
    text_offset = image_tokens
    if blocks_cover_whole_prompt(record):
        text_offset, block_tokens = 0, record.hash_block_tokens or block_tokens
    ids = [_OWN_TOKEN] * text_offset
    for block in record.hash_ids or ():
        take = min(block_tokens, total - len(ids))
        if take <= 0:
            break
        ids += [block] * take
    own_from = len(ids)
    ids += [own] * (total - len(ids))
    return ids, own_from


def affinity_key(record: TraceRecord) -> str | None:
    """What the router's prefix key stands for in a trace: the conversation (its session),
    else the first shared block; None routes by load alone."""
    if record.session_id is not None:
        return f"session:{record.session_id}"
    if record.hash_ids:
        return f"block:{record.hash_ids[0]}"
    return None


def best_case_hits(
    records: Sequence[TraceRecord],
    image_tokens: Callable[[int], int] = int,
    block_tokens: int = HASH_BLOCK_TOKENS,
) -> list[int]:
    """Per record, the prompt tokens a prefix cache could serve it at best (an unbounded
    cache that every earlier request reached), or, where no record has blocks, its recorded
    ``cached_tokens``. At least one token is computed. The plan search's bound counts only
    the rest as prefill work, so it stays an upper bound on what a plan sustains.
    ``image_tokens``: an image's tokens (the cost model's ``image_tokens``).

    An earlier request's written tokens (prompt and answer) run along its leading images and
    blocks (as ``prompt_token_ids`` lays them out) or, for a turn written with its next
    turn's ids (``sim_turns.py``), along its conversation's last turn's: a record finds, on
    either of its own runs, as deep as an earlier one went, and all of an earlier turn of
    its own conversation."""
    if not models_prefix_cache(records):
        return [max(0, min(r.cached_tokens or 0, _total(r, image_tokens) - 1)) for r in records]
    last_turn = _last_turns(records)
    runs = {i: _units(r, image_tokens, block_tokens) for i, r in enumerate(records)}
    # leading runs met so far, as a trie: (parent node, image hash or block id) -> node;
    # ``deepest``: the most tokens an earlier request wrote through a node
    trie: dict[tuple[int, str | int], int] = {}
    deepest: dict[int, int] = {}
    conversation_best: dict[int, int] = {}  # last turn -> most tokens an earlier turn wrote
    hits = [0] * len(records)
    for index in sorted(range(len(records)), key=lambda i: records[i].arrival_s):
        record = records[index]
        total = _total(record, image_tokens)
        written = total + record.output_tokens - 1  # the last token is sampled, not written
        paths = [runs[index], runs[last_turn[index]]]
        hit = conversation_best.get(last_turn[index], 0)
        for path in paths:
            node, depth = 0, 0
            for unit, tokens in path:
                found = trie.get((node, unit))
                if found is None:
                    break
                node, depth = found, depth + tokens
                hit = max(hit, min(depth, deepest[node]))
        hits[index] = max(0, min(hit, total - 1))
        for path in paths:
            node = 0
            for unit, _ in path:
                node = trie.setdefault((node, unit), len(trie) + 1)
                deepest[node] = max(deepest.get(node, 0), written)
        end = last_turn[index]
        conversation_best[end] = max(conversation_best.get(end, 0), written)
    return hits


def _total(record: TraceRecord, image_tokens: Callable[[int], int]) -> int:
    return sum(image_tokens(image.tokens) for image in record.images) + record.prompt_tokens


def _units(
    record: TraceRecord, image_tokens: Callable[[int], int], block_tokens: int
) -> list[tuple[str | int, int]]:
    """A prompt's leading run as ``prompt_token_ids`` lays it out: images, then blocks."""
    units: list[tuple[str | int, int]] = []
    if not blocks_cover_whole_prompt(record):  # else its images are in its blocks' ids
        units += [(image.hash, image_tokens(image.tokens)) for image in record.images]
    size = record.hash_block_tokens or block_tokens
    return units + [(block, size) for block in record.hash_ids or ()]


def _last_turns(records: Sequence[TraceRecord]) -> list[int]:
    """Per record, its conversation's last turn (itself where the trace tells no next)."""
    following = next_turns(records)
    last = list(range(len(records)))
    for index in sorted(range(len(records)), key=lambda i: records[i].arrival_s, reverse=True):
        if index in following:
            last[index] = last[following[index]]
    return last
