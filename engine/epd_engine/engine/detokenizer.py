"""Incremental detokenization with stop strings: cost per token ∝ the new text, not the output.

Only a short window of ids is decoded per token (vLLM's prefix/read offsets): the text of
``ids[prefix:]`` minus the text of ``ids[prefix:read]`` is what the new ids add, because
the tokenizer may merge bytes across token boundaries. While that ends in an incomplete
UTF-8 sequence (``\\ufffd``) nothing is confirmed and the window grows. Stop strings are
searched only where new text could complete one, and text that could be the start of a
stop string is held back until it cannot.

A client that gets only the whole answer and has no stop strings needs no text before the
end (``whole_text_only``): its ids are kept and decoded once, at the last one, which is the
text the incremental path would give (``test_detokenizer``) at one decode per request
instead of two per token.
"""

from __future__ import annotations

from collections.abc import Callable

# Ids re-decoded before the new ones on resume: enough context for merges at the seam.
_RESUME_CONTEXT = 6


class Detokenizer:
    def __init__(
        self,
        decode: Callable[[list[int]], str],
        stop: tuple[str, ...] = (),
        min_tokens: int = 0,
        whole_text_only: bool = False,
    ) -> None:
        if whole_text_only and stop:
            raise ValueError("stop strings need the text as it grows")
        self.decode = decode
        self.whole_text_only = whole_text_only
        self.stop = stop
        self.min_tokens = min_tokens  # stop strings do not count before this many tokens
        self.token_ids: list[int] = []
        self.text = ""  # confirmed text of token_ids[:read_offset]
        self.stopped = False
        self._prefix_offset = 0
        self._read_offset = 0
        self._emitted_len = 0  # text[:_emitted_len] has been sent to the client
        self._searched = 0  # no stop string starts before this index of text
        self._longest_stop = max((len(s) for s in stop), default=0)

    @classmethod
    def resume(
        cls,
        decode: Callable[[list[int]], str],
        stop: tuple[str, ...],
        token_ids: list[int],
        emitted_text: str,
        min_tokens: int = 0,
        whole_text_only: bool = False,
    ) -> Detokenizer:
        """Continue an output a client already has part of (a migrated or retried request);
        ``whole_text_only`` holds only while the client has no text yet."""
        if whole_text_only and not stop and not emitted_text:
            detok = cls(decode, whole_text_only=True)
            detok.token_ids = list(token_ids)
            return detok
        detok = cls(decode, stop, min_tokens)
        detok.token_ids = list(token_ids)
        read = len(token_ids)
        text = decode(detok.token_ids)
        while read > 0 and text.endswith("\ufffd") and len(token_ids) - read < 4:
            read -= 1  # leave an incomplete character to the incremental path
            text = decode(detok.token_ids[:read])
        detok.text = text
        detok._read_offset = read
        detok._prefix_offset = max(read - _RESUME_CONTEXT, 0)
        emitted = len(emitted_text) if text.startswith(emitted_text) else 0
        detok._emitted_len = emitted
        detok._searched = emitted
        return detok

    @property
    def emitted(self) -> str:
        """The text already sent to the client."""
        return self.text[: self._emitted_len]

    def add(self, token_id: int, final: bool) -> str:
        """New text to send after ``token_id``; sets ``stopped`` when a stop string appears."""
        self.token_ids.append(token_id)
        if self.whole_text_only:
            if final:
                self.text = self.decode(self.token_ids)
                return self._emit_upto(len(self.text))
            return ""
        self._advance(final)
        if self.stop and len(self.token_ids) < self.min_tokens:
            self._searched = len(self.text)  # too early: these stops do not count
        elif self.stop:
            cut = self._find_stop()
            if cut is not None:
                self.stopped = True
                self.text = self.text[:cut]
                return self._emit_upto(cut)
        if final:
            return self._emit_upto(len(self.text))
        return self._emit_upto(len(self.text) - self._stop_prefix_len())

    def _advance(self, final: bool) -> None:
        window = self.token_ids[self._prefix_offset :]
        known = self.decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self.decode(window)
        if len(full) <= len(known) or (full.endswith("\ufffd") and not final):
            return  # nothing new yet, or a character still incomplete
        self.text += full[len(known) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)

    def _find_stop(self) -> int | None:
        """Index of a stop string in text not searched before (the first one listed wins)."""
        start = max(self._searched - self._longest_stop + 1, 0)
        for stop in self.stop:
            cut = self.text.find(stop, start)
            if cut != -1:
                return cut
        self._searched = len(self.text)
        return None

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of text that could begin a stop string."""
        longest = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def _emit_upto(self, end: int) -> str:
        if end <= self._emitted_len:
            return ""
        delta = self.text[self._emitted_len : end]
        self._emitted_len = end
        return delta
