"""Server-sent chunks of chat and text completions, as OpenAI sends them.

One writer per streamed response, used by an instance and by the router alike, so both send
the same bytes: ``finish_reason`` and ``logprobs`` are explicit ``null`` until they have a
value, ``usage`` is ``null`` on every chunk when the client asked for ``include_usage`` (and
carries the running counts with ``continuous_usage_stats``, as vLLM does), and every chunk
names the ``system_fingerprint``.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from epd_engine.api.logprobs import completion_logprobs
from epd_engine.api.protocol import SYSTEM_FINGERPRINT, StreamOptions, Usage, token_usage

Kind = Literal["chat", "completion"]


class ChunkWriter:
    """Formats the chunks of one streamed response (``kind`` chat or text completion)."""

    def __init__(
        self, kind: Kind, request_id: str, model: str, options: StreamOptions | None
    ) -> None:
        self.kind = kind
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.include_usage = bool(options and options.include_usage)
        self.continuous_usage = self.include_usage and bool(
            options and options.continuous_usage_stats
        )
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0
        self.num_cached_tokens = 0  # callers update it as they learn it (running usage)
        self.text_offset = 0  # completions' logprobs: characters of token text sent so far

    def _event(
        self, choices: list[dict[str, Any]], usage: Usage | None, extra: dict[str, Any] | None
    ) -> str:
        body: dict[str, Any] = {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": choices,
        }
        if self.include_usage:
            body["usage"] = usage.model_dump(exclude_none=True) if usage else None
        body |= extra or {}
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    def _running_usage(self) -> Usage | None:
        if not self.continuous_usage:
            return None
        return token_usage(self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens)

    def start(self, num_prompt_tokens: int) -> str | None:
        """The role chunk that opens a chat stream (text completions have none)."""
        self.num_prompt_tokens = num_prompt_tokens
        if self.kind != "chat":
            return None
        choice: dict[str, Any] = {"index": 0, "delta": {"role": "assistant", "content": ""}}
        choice |= {"logprobs": None, "finish_reason": None}
        return self._event([choice], self._running_usage(), None)

    def tokens(
        self,
        text: str,
        num_tokens: int,
        finish_reason: str | None,
        logprobs: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """A chunk with new text (and the finish reason on the last one); ``logprobs``: the
        new tokens' rendered entries (``TokenLogprob`` dicts), shaped here for the kind;
        ``extra`` adds non-standard top-level fields (the router's stage timings)."""
        self.num_output_tokens += num_tokens
        shaped: dict[str, Any] | None = None
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text} if text else {}}
            shaped = {"content": logprobs} if logprobs else None
        else:
            choice = {"index": 0, "text": text}
            if logprobs:
                shaped = completion_logprobs(logprobs, self.text_offset).model_dump()
                self.text_offset += sum(len(entry["token"]) for entry in logprobs)
        choice |= {"logprobs": shaped, "finish_reason": finish_reason}
        return self._event([choice], self._running_usage(), extra)

    def usage(self, usage: Usage) -> str | None:
        """The last chunk with the totals and no choices (only with ``include_usage``)."""
        return self._event([], usage, None) if self.include_usage else None
