"""A conversation's answer pages in the simulator (issue 33).

The engine keeps a finished request's full pages cached, its generated tokens' included,
and a conversation's next turn resends that prompt and answer, so its prefill finds them.
The simulator's token ids are stand-ins (``sim_prefix.py``): a prompt's tail past its
blocks and the tokens it generates would be ids no other prompt has. So a turn whose next
turn the trace tells is written with that turn's ids: its prompt's tail and the tokens it
generates are the next turn's at those positions (``TurnScript``), and the next turn finds
the pages the engine's would.

A record's next turn: the next record of its session (``session_id``); in the router's live
trace, which has no sessions, the next record whose ids begin with all of its own (each id
names its whole prefix) and that holds its prompt and answer. Two conversations that open
alike and part later are taken for one up to where they part: a hit the engine gets only
when their answers were the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from epd_engine.contracts.trace import TraceRecord
from epd_engine.request import ImageRef


def next_turns(records: Sequence[TraceRecord]) -> dict[int, int]:
    """Record index -> the index of its conversation's next turn, where the trace tells."""
    following: dict[int, int] = {}
    last_of_session: dict[str, int] = {}
    # live records waiting for their next turn, by (number of ids, last id): their prefix
    waiting: dict[tuple[int, int], list[int]] = {}
    for index in sorted(range(len(records)), key=lambda i: records[i].arrival_s):
        record = records[index]
        if record.session_id is not None:
            if record.session_id in last_of_session:
                following[last_of_session[record.session_id]] = index
            last_of_session[record.session_id] = index
            continue
        ids = record.hash_ids
        if not ids or record.hash_block_tokens is None:  # not the router's: no chain
            continue
        for depth, block in enumerate(ids, start=1):
            for earlier in waiting.pop((depth, block), []):
                if _holds(record, records[earlier]):
                    following[earlier] = index
                else:  # the same prompt again, say: the next turn is still to come
                    waiting.setdefault((depth, block), []).append(earlier)
        waiting.setdefault((len(ids), ids[-1]), []).append(index)
    return following


def _holds(later: TraceRecord, earlier: TraceRecord) -> bool:
    """Whether ``later``'s prompt is long enough to resend ``earlier``'s and its answer."""
    return later.total_prompt_tokens >= earlier.total_prompt_tokens + earlier.output_tokens


@dataclass(frozen=True)
class Laid:
    """A record's simulated prompt: its token ids, its images, and where its own ids begin
    (past its blocks: what no other prompt shares)."""

    token_ids: list[int]
    images: list[ImageRef]
    own_from: int


class TurnScript:
    """Prompts and answers of a trace's requests, each turn written with its next turn's ids.

    ``layout``: a record's simulated prompt on its own (``RequestFactory``)."""

    def __init__(self, records: Sequence[TraceRecord], layout: Callable[[int], Laid]) -> None:
        self.records = records
        self.layout = layout
        self.following = next_turns(records)
        self._scripted: dict[int, list[int]] = {}  # prompts made for an earlier turn's sake

    def prompt_and_answer(self, index: int) -> tuple[list[int], list[int]]:
        """Request ``index``'s prompt ids and the ids it generates ([]: any)."""
        chain = [index]  # the turns from this one on whose prompts are still to write
        while chain[-1] in self.following and self.following[chain[-1]] not in self._scripted:
            chain.append(self.following[chain[-1]])
        answer: list[int] = []
        for turn in reversed(chain):
            prompt, answer = self._script(turn)
            self._scripted[turn] = prompt
        return self._scripted.pop(index), answer

    def _script(self, index: int) -> tuple[list[int], list[int]]:
        laid = self.layout(index)
        later = self.following.get(index)
        if later is None:
            return laid.token_ids, []
        next_ids = self._scripted[later]
        next_images = self.layout(later).images
        shared = laid.own_from
        total = len(laid.token_ids)
        if (
            next_ids[:shared] != laid.token_ids[:shared]
            or next_images[: len(laid.images)] != laid.images
            or len(next_ids) <= total
        ):
            return laid.token_ids, []  # laid out apart (images first, say): nothing to script
        output = self.records[index].output_tokens
        return next_ids[:total], next_ids[total : total + output]
