"""Engine log-probabilities in OpenAI's ``choices[].logprobs.content[]`` shape."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from epd_engine.sampling import TokenLogprobs
from epd_engine.server.protocol import ChoiceLogprobs, TokenLogprob, TopLogprob

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
