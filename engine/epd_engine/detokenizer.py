"""Incremental detokenization with stop strings.

Text is re-decoded from all output ids (the tokenizer may merge bytes across tokens), and
text that could be the start of a stop string, or an incomplete UTF-8 sequence, is held back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Detokenizer:
    decode: Callable[[list[int]], str]
    stop: tuple[str, ...] = ()
    token_ids: list[int] = field(default_factory=list)
    emitted: str = ""  # text already sent to the client
    stopped: bool = False

    def add(self, token_id: int, final: bool) -> str:
        """New text to send after ``token_id``; sets ``stopped`` when a stop string appears."""
        self.token_ids.append(token_id)
        text = self.decode(self.token_ids)
        for stop in self.stop:
            cut = text.find(stop)
            if cut != -1:
                self.stopped = True
                text = text[:cut]
                return self._emit_upto(text, len(text))
        if final:
            return self._emit_upto(text, len(text))
        safe = len(text)
        if text.endswith("\ufffd"):
            safe = len(text.rstrip("\ufffd"))
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    safe = min(safe, len(text) - k)
                    break
        return self._emit_upto(text, safe)

    def _emit_upto(self, text: str, end: int) -> str:
        if end <= len(self.emitted) or not text.startswith(self.emitted):
            return ""
        delta = text[len(self.emitted) : end]
        self.emitted = text[:end]
        return delta
