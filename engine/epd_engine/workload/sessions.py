"""Multi-turn sessions in a replay: records sharing a ``session_id`` are the turns of one
conversation, in arrival order. A turn is sent at its arrival time but never before the
previous turn has ended, and its messages are the whole conversation so far (every earlier
user message and the reply the server actually gave) followed by its own.

A turn's ``prompt_tokens`` counts its own user message; the server's count adds the history,
which depends on the replies, so only a session's first turn is checked against ``usage``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from epd_engine.contracts.trace import TraceRecord


@dataclass
class Conversation:
    messages: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Turn:
    """One record's place in its conversation."""

    conversation: Conversation
    index: int  # 0 for the session's first turn
    previous: asyncio.Event | None
    done: asyncio.Event = field(default_factory=asyncio.Event)

    async def wait_previous(self) -> None:
        if self.previous is not None:
            await self.previous.wait()

    def history(self) -> list[dict[str, Any]]:
        return list(self.conversation.messages)

    def finish(self, user_messages: list[dict[str, Any]], reply: str) -> None:
        """Add this turn and the server's reply to the conversation; let the next go."""
        self.conversation.messages += [*user_messages, {"role": "assistant", "content": reply}]
        self.done.set()


def plan_turns(records: Sequence[TraceRecord]) -> dict[int, Turn]:
    """Record index -> its turn, for records with a ``session_id`` (call inside the loop
    that runs the replay: the turns' events belong to it)."""
    order = sorted(range(len(records)), key=lambda i: records[i].arrival_s)
    turns: dict[int, Turn] = {}
    last: dict[str, Turn] = {}
    for i in order:
        session = records[i].session_id
        if session is None:
            continue
        before = last.get(session)
        conversation = before.conversation if before else Conversation()
        turn = Turn(conversation, before.index + 1 if before else 0,
                    before.done if before else None)  # fmt: skip
        turns[i] = last[session] = turn
    return turns
