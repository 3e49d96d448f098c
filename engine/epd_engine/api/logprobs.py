"""Engine log-probabilities in OpenAI's shapes: chat's ``choices[].logprobs.content[]`` and
text completions' ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``.

Instances render each token once (``TokenLogprob``, as dicts on the way to the router, which
has no tokenizer); the completions shape is built from those entries."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from epd_engine.api.protocol import ChoiceLogprobs, TokenLogprob, TopLogprob
from epd_engine.sampling import TokenLogprobs

# OpenAI reports tokens outside the sampled set (top-k/top-p cut: -inf) as -9999.0; JSON
# has no infinity.
FLOOR = -9999.0


def logprob_content(
    token_ids: list[int], logprobs: list[TokenLogprobs], token_text: Callable[[int], str]
) -> list[TokenLogprob]:
    """One entry per generated token (``token_text``: one token's text, specials kept)."""
    content = []
    for token_id, lp in zip(token_ids, logprobs, strict=True):
        top = [_entry(t, value, token_text) for t, value in lp.top]
        chosen = _entry(token_id, lp.logprob, token_text)
        content.append(TokenLogprob(**chosen.model_dump(), top_logprobs=top))
    return content


def choice_logprobs(content: list[TokenLogprob] | None) -> ChoiceLogprobs | None:
    return None if content is None else ChoiceLogprobs(content=content)


def _entry(token_id: int, logprob: float, token_text: Callable[[int], str]) -> TopLogprob:
    text = token_text(token_id)
    return TopLogprob(token=text, logprob=max(logprob, FLOOR), bytes=list(text.encode()))


def token_text_of(tokenizer: Any) -> Callable[[int], str]:
    """One token's text as logprobs show it (special tokens kept)."""
    return lambda token_id: str(tokenizer.decode([token_id]))


class CompletionLogprobs(BaseModel):
    """``/v1/completions`` logprobs: per token its text, logprob, the top alternatives (the
    sampled token always among them, so up to ``logprobs`` + 1) and its offset in the text."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


def completion_logprobs(entries: list[dict[str, Any]], offset: int = 0) -> CompletionLogprobs:
    """From rendered entries (``TokenLogprob`` dicts); ``offset``: the text's length before
    the first of them (a stream's later chunks)."""
    result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for entry in entries:
        top = {t["token"]: t["logprob"] for t in entry["top_logprobs"]}
        top.setdefault(entry["token"], entry["logprob"])
        result.tokens.append(entry["token"])
        result.token_logprobs.append(entry["logprob"])
        result.top_logprobs.append(top)
        result.text_offset.append(offset)
        offset += len(entry["token"])
    return result
