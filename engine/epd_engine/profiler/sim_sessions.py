"""A session trace's turns as the whole prompts the server sees (issue 33).

A record of a session (``session_id``) counts only its own message in ``prompt_tokens`` and
carries only its own images (``TraceRecord.whole_prompt``): that is what ``epdctl bench``
replays, sending the conversation so far before it. The simulator serves whole prompts, so
it reads a trace through ``whole_prompts``: each turn becomes the router's live form -- the
conversation's text, every image so far at its offset, and ids naming its full blocks over
the whole prompt (``hash_block_tokens``) -- which ``sim_prefix.py`` lays out as the server
had it and ``sim_turns.py`` writes so the next turn finds the answer's pages.

A conversation is laid out as ``epdctl bench`` sends it: each user message's images, then
its text, then the reply. The few chat-template tokens each earlier message adds to a
longer prompt are not counted. A block's id names its content and everything before it (a
chain, as the engine's page keys), so turns of one conversation share their earlier blocks,
and conversations share theirs only where they open alike (the same image or Mooncake
``hash_ids`` blocks first).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from epd_engine.contracts.trace import ImageRef, TraceRecord
from epd_engine.profiler.sim_prefix import HASH_BLOCK_TOKENS

SESSION_BLOCK_TOKENS = 64  # the router's live-trace block (``cache/trace_blocks.py``)
_FIRST_ID = 1 << 48  # above Mooncake's block counters: a chain id never equals one of them

# What a run of tokens holds: ("image", hash), ("block", Mooncake id), ("text" | "answer",
# session, turn); a run's tokens are that content in order.
Label = tuple[str | int, ...]


def whole_prompts(records: Sequence[TraceRecord]) -> Sequence[TraceRecord]:
    """``records`` with each session-form turn replaced by its whole prompt (same order;
    records already whole are kept as they are, so a second call changes nothing)."""
    if all(record.whole_prompt for record in records):
        return records
    chain = _Chain()
    conversations: dict[str, _Conversation] = {}
    out = list(records)
    for index in sorted(range(len(records)), key=lambda i: records[i].arrival_s):
        record = records[index]
        if record.whole_prompt or record.session_id is None:
            continue
        conversation = conversations.setdefault(record.session_id, _Conversation())
        out[index] = conversation.next_turn(record, chain)
    return out


class _Chain:
    """Block ids by (the previous block's id, the block's content): equal prompts up to a
    block have equal ids up to it (one table per conversion)."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, tuple[tuple[Label, int], ...]], int] = {}

    def id(self, parent: int, pieces: Sequence[tuple[Label, int]]) -> int:
        return self._ids.setdefault((parent, tuple(pieces)), _FIRST_ID + len(self._ids))


@dataclass
class _Conversation:
    """One session so far: the ids of its full blocks, the runs of its last partial block,
    its images at their offsets, its length and its text tokens."""

    ids: list[int] = field(default_factory=list)
    pieces: list[tuple[Label, int]] = field(default_factory=list)
    images: list[ImageRef] = field(default_factory=list)
    length: int = 0
    text_tokens: int = 0
    turns: int = 0

    def next_turn(self, record: TraceRecord, chain: _Chain) -> TraceRecord:
        """The whole prompt of ``record`` (this conversation's next turn); then its answer
        joins the conversation."""
        session, turn = record.session_id or "", self.turns
        for image in record.images:
            self.images.append(image.model_copy(update={"offset": self.length}))
            self._append(("image", image.hash), image.tokens, chain)
        for label, tokens in _text_runs(record, ("text", session, turn)):
            self._append(label, tokens, chain)
        whole = record.model_copy(
            update={
                "prompt_tokens": self.text_tokens + record.prompt_tokens,
                "images": tuple(self.images),
                "hash_ids": tuple(self.ids),
                "hash_block_tokens": SESSION_BLOCK_TOKENS,
            }
        )
        self._append(("answer", session, turn), record.output_tokens, chain)
        self.text_tokens += record.prompt_tokens + record.output_tokens
        self.turns += 1
        return whole

    def _append(self, label: Label, tokens: int, chain: _Chain) -> None:
        """``tokens`` more of ``label``: each block they fill gets its id."""
        self.length += tokens
        filled = sum(count for _, count in self.pieces)
        while tokens:
            take = min(tokens, SESSION_BLOCK_TOKENS - filled)
            self.pieces.append((label, take))
            tokens, filled = tokens - take, filled + take
            if filled == SESSION_BLOCK_TOKENS:
                self.ids.append(chain.id(self.ids[-1] if self.ids else 0, self.pieces))
                self.pieces, filled = [], 0


def _text_runs(record: TraceRecord, own: Label) -> list[tuple[Label, int]]:
    """A message's text: its Mooncake blocks (shared with whoever has them), then its own."""
    runs: list[tuple[Label, int]] = []
    left = record.prompt_tokens
    for block in record.hash_ids or ():
        take = min(HASH_BLOCK_TOKENS, left)
        if take <= 0:
            break
        runs.append((("block", block), take))
        left -= take
    if left:
        runs.append((own, left))
    return runs
