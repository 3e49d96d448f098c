"""Incremental detokenizing gives the text the old full re-decode gave, on the real tokenizer."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from epd_engine.engine.detokenizer import Detokenizer

PIECES = [
    "héllo",
    " wörld",
    " 日本語",
    " 🙂🙃",
    " naïve café",
    " ASSISTANT:",
    " ünïcödé",
    "\n",
    " €",
    " 👩‍🚀",
]


@dataclass
class FullRedecode:
    """The detokenizer this replaces, kept verbatim as the reference: re-decode everything."""

    decode: Callable[[list[int]], str]
    stop: tuple[str, ...] = ()
    token_ids: list[int] = field(default_factory=list)
    emitted: str = ""
    stopped: bool = False

    def add(self, token_id: int, final: bool) -> str:
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


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def run(detok, ids: list[int]) -> tuple[str, int | None]:
    """All text sent, and after how many tokens a stop string ended the output."""
    text = ""
    for n, token in enumerate(ids, start=1):
        text += detok.add(token, final=n == len(ids))
        if detok.stopped:
            return text, n
    return text, None


def random_ids(rng: random.Random, tokenizer) -> list[int]:
    """Encoded multi-byte text cut at random places, mixed with random ids (split bytes,
    special tokens, characters that never complete)."""
    ids: list[int] = []
    for _ in range(rng.randint(1, 12)):
        if rng.random() < 0.6:
            piece = tokenizer.encode(rng.choice(PIECES), add_special_tokens=False)
            ids += piece[rng.randint(0, len(piece) - 1) :] if rng.random() < 0.2 else piece
        else:
            ids += [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 4))]
    return ids


def test_text_is_identical_to_the_full_redecode_on_random_sequences(tokenizer):
    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    rng = random.Random(0)
    for case in range(300):
        ids = random_ids(rng, tokenizer)
        assert run(Detokenizer(decode), ids) == run(FullRedecode(decode), ids), (case, ids)


def test_whole_text_only_sends_the_same_text_at_the_end_in_one_decode(tokenizer):
    calls = []

    def decode(ids):
        calls.append(len(ids))
        return tokenizer.decode(ids, skip_special_tokens=True)

    rng = random.Random(1)
    for case in range(300):
        ids = random_ids(rng, tokenizer)
        whole = Detokenizer(decode, whole_text_only=True)
        deltas = [whole.add(token, final=n == len(ids)) for n, token in enumerate(ids, start=1)]
        calls.clear()
        assert deltas[:-1] == [""] * (len(ids) - 1), case
        assert deltas[-1] == run(Detokenizer(decode), ids)[0], (case, ids)
    whole = Detokenizer(decode, whole_text_only=True)
    calls.clear()
    for n in range(1, 41):
        whole.add(7 + n, final=n == 40)
    assert calls == [40]
    with pytest.raises(ValueError, match="stop strings"):
        Detokenizer(decode, ("x",), whole_text_only=True)


def test_a_whole_answer_resumed_elsewhere_still_gets_all_its_text_at_the_end(tokenizer):
    """A request whose client reads the whole answer moves (P to D, or a retry) with no
    text sent yet: the next instance decodes every id, those made before it included."""

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    ids = tokenizer.encode("héllo wörld 日本語 naïve café 🙂", add_special_tokens=False)
    first = Detokenizer(decode, whole_text_only=True)
    assert [first.add(t, final=False) for t in ids[:5]] == [""] * 5
    resumed = Detokenizer.resume(decode, (), ids[:5], first.emitted, whole_text_only=True)
    assert resumed.whole_text_only
    text = "".join(resumed.add(t, final=n == len(ids)) for n, t in enumerate(ids[5:], start=6))
    assert text == decode(ids)
    # a client that already has text (an earlier streaming attempt) keeps the incremental path
    partial = Detokenizer.resume(decode, (), ids[:5], decode(ids[:2]), whole_text_only=True)
    assert not partial.whole_text_only


def test_stop_strings_cut_at_their_first_occurrence_and_are_never_sent(tokenizer):
    """Exact stops on random outputs. The old detokenizer sent the start of a stop string
    when an incomplete character followed it (``" 日"`` of stop ``" 日本"``, as in the
    case pinned below): its hold-back looked at the text with the ``\ufffd`` still on."""

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    rng = random.Random(1)
    cases = [(random_ids(rng, tokenizer), rng) for _ in range(300)]
    for case, (ids, _) in enumerate(cases):
        full_text = decode(ids).rstrip("\ufffd")
        if len(full_text) < 4:
            continue
        at = rng.randrange(len(full_text) - 2)
        stop = full_text[at : at + rng.randint(1, 3)]
        if "\ufffd" in stop:
            continue
        text, stopped_at = run(Detokenizer(decode, (stop,)), ids)
        assert stopped_at is not None, (case, ids, stop)
        assert text == full_text[: full_text.find(stop)], (case, ids, stop)
    pinned = tokenizer.encode(" ünïcödé 日本語", add_special_tokens=False)
    assert run(Detokenizer(decode, (" 日本",)), pinned)[0] == " ünïcödé"


def test_stop_string_split_across_tokens_is_cut_exactly_and_never_sent(tokenizer):
    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    ids = tokenizer.encode("The image shows a red car", add_special_tokens=False)
    text, stopped_at = run(Detokenizer(decode, ("red c",)), ids)
    assert text == "The image shows a "
    assert stopped_at is not None


def test_stop_strings_do_not_count_before_min_tokens(tokenizer):
    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    ids = tokenizer.encode(" car car car car", add_special_tokens=False)
    detok = Detokenizer(decode, ("car",), min_tokens=len(ids) - 1)
    text, stopped_at = run(detok, ids)
    assert stopped_at == len(ids)  # only the last " car" could stop it
    assert text == " car car car "


def test_resume_continues_an_output_the_client_already_has(tokenizer):
    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    ids = tokenizer.encode("héllo wörld 日本語 naïve café 🙂", add_special_tokens=False)
    for split in range(1, len(ids)):
        first = Detokenizer(decode)
        for token in ids[:split]:
            first.add(token, final=False)
        resumed = Detokenizer.resume(decode, (), ids[:split], first.emitted)
        rest, _ = run(resumed, ids[split:])
        assert first.emitted + rest == decode(ids), split


def test_work_per_token_does_not_grow_with_the_output(tokenizer):
    """The defect: every token re-decoded the whole output (quadratic in its length)."""
    decoded: list[int] = []

    def decode(ids):
        decoded.append(len(ids))
        return tokenizer.decode(ids, skip_special_tokens=True)

    ids = tokenizer.encode("The image shows a red car parked. " * 60, add_special_tokens=False)
    run(Detokenizer(decode), ids)
    assert max(decoded) <= 8
