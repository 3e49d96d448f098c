"""Prompts of an exact token count, built and checked with the served model's tokenizer.

Two ways to count, because peers differ:

- ``template`` (default): the prompt's non-image tokens *as the server counts them*, chat
  template and BOS included. This is what the router records as a trace's ``prompt_tokens``,
  so replaying a recorded trace reproduces it, and ``usage.prompt_tokens`` must equal
  ``prompt_tokens + image tokens`` exactly.
- ``content``: the user text alone tokenizes to N tokens (no special tokens, no template),
  which is what AIPerf's and vLLM's random datasets call the input length.

Text is a sequence of whole-word vocabulary tokens (space-prefixed, alphabetic) drawn from a
seeded generator, so it round-trips through the tokenizer; the final count is verified by
tokenizing the full prompt and trimmed or padded until exact. Prefix blocks (Mooncake
``hash_ids``) are texts seeded by the block id, so requests sharing ids share a text prefix.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

CountMode = Literal["template", "content"]
COUNT_MODES: tuple[CountMode, ...] = ("template", "content")
_MAX_FIXES = 12


class PromptLengthError(ValueError):
    """A tokenizer too poor in whole-word tokens to build prompts from."""


def _word_ids(tokenizer: Any) -> list[int]:
    """Ids of tokens that are one whole word with its leading space (and stay one token)."""
    ids: list[int] = []
    # low ids are the early (frequent) merges; a couple of thousand words is plenty
    for token, token_id in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        if len(ids) >= 2000:
            break
        if token_id in tokenizer.all_special_ids or token[:1] not in ("Ġ", "▁"):
            continue
        word = token[1:]
        if not (len(word) >= 2 and word.isascii() and word.isalpha()):
            continue
        if tokenizer.encode(" " + word, add_special_tokens=False) == [token_id]:
            ids.append(token_id)
    if len(ids) < 8:
        raise PromptLengthError(
            f"the tokenizer has only {len(ids)} whole-word tokens; cannot build exact prompts"
        )
    return sorted(ids)


def _image_token_id(tokenizer: Any, model_dir: Path) -> int | None:
    config_path = model_dir / "config.json"
    if config_path.exists():
        config = json.loads(config_path.read_text())
        for key in ("image_token_index", "image_token_id"):
            if isinstance(config.get(key), int):
                return int(config[key])
    token_id = tokenizer.convert_tokens_to_ids("<image>")
    return token_id if isinstance(token_id, int) and token_id != tokenizer.unk_token_id else None


@dataclass
class TokenExactPrompts:
    """Builds user texts whose token count (``mode``) is exactly what a trace asks for."""

    tokenizer: Any
    image_token_id: int | None
    mode: CountMode = "template"

    @classmethod
    def from_model_dir(cls, path: str | Path, mode: CountMode = "template") -> TokenExactPrompts:
        from transformers import AutoTokenizer

        if mode not in COUNT_MODES:
            raise ValueError(f"count mode must be one of {COUNT_MODES}, got {mode!r}")
        model_dir = Path(path)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        if tokenizer.chat_template is None and (model_dir / "chat_template.json").exists():
            # processor checkpoints (LLaVA) keep the template beside the tokenizer
            template = json.loads((model_dir / "chat_template.json").read_text())
            tokenizer.chat_template = template["chat_template"]
        if mode == "template" and tokenizer.chat_template is None:
            raise ValueError(f"{model_dir} has no chat template; use --prompt-count content")
        return cls(tokenizer, _image_token_id(tokenizer, model_dir), mode)

    @cached_property
    def words(self) -> list[int]:
        return _word_ids(self.tokenizer)

    def count(self, text: str, num_images: int = 0, mode: CountMode | None = None) -> int:
        """Tokens of ``text`` as ``mode`` (default: this builder's) counts them."""
        if (mode or self.mode) == "content":
            return len(self.tokenizer.encode(text, add_special_tokens=False))
        content: list[dict[str, str]] = [{"type": "image"}] * num_images
        messages = [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]
        rendered = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        ids = self.tokenizer.encode(rendered)
        return sum(1 for i in ids if i != self.image_token_id)

    def server_count(self, text: str, num_images: int = 0) -> int:
        """Non-image tokens the server will count for ``text`` (template mode's count)."""
        return self.count(text, num_images, mode="template")

    def overhead(self, num_images: int = 0) -> int:
        """Tokens the template adds around an empty user text."""
        return self.count("", num_images)

    def block_text(self, block_id: int | str, num_tokens: int) -> str:
        """A text of ``num_tokens`` whole-word tokens, the same for the same block id."""
        rng = random.Random(f"block/{block_id}")
        return self.tokenizer.decode(rng.choices(self.words, k=num_tokens))

    def text(
        self,
        num_tokens: int,
        seed: str,
        num_images: int = 0,
        prefix_blocks: Sequence[int | str] = (),
        block_tokens: int = 512,
    ) -> str:
        """A user text such that ``count(text, num_images) == num_tokens`` (or as close as
        possible: never below the template's own tokens).

        ``prefix_blocks`` start the text with shared blocks of ``block_tokens`` each (the last
        one cut short when the prompt ends inside it); only the unique tail is adjusted.
        """
        # A count below the template's own tokens cannot be hit: send the shortest prompt;
        # the usage check reports the difference (a recorded trace never asks for that).
        budget = max(0, num_tokens - self.overhead(num_images))
        prefix, used = "", 0
        for block in prefix_blocks:  # word tokens add up, so blocks never overshoot the budget
            take = min(block_tokens, budget - used)
            if take <= 0:
                break
            prefix += self.block_text(block, take)
            used += take
        rng = random.Random(seed)
        tail: list[int] = []
        for _ in range(_MAX_FIXES):  # best effort past that; the usage check reports a miss
            text = prefix + self.tokenizer.decode(tail)
            missing = num_tokens - self.count(text, num_images)
            if missing > 0:
                tail += rng.choices(self.words, k=missing)
            elif missing < 0 and tail:
                del tail[max(0, len(tail) + missing) :]
            else:
                break
        return prefix + self.tokenizer.decode(tail)
