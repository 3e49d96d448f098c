"""The tokenizer of a made-up Gemma 3 checkpoint, built the way Gemma's own is.

Spaces become "▁", the BPE falls back to ``<0xNN>`` byte tokens, and ``<unk>`` is in the
model's vocabulary. transformers 5 does not read a Gemma ``tokenizer.json``'s pipeline: its
``GemmaTokenizer`` rebuilds this one from the file's vocabulary and merges (and refuses to
encode when ``<unk>`` is missing from them: "Unk token `<unk>` not found in the vocabulary",
seen on a GPU machine with transformers 5.17), while transformers 4 loads the file as it is;
with the same pipeline in the file both give the same ids.
"""

from __future__ import annotations

import json

from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from epd_engine.model.gemma3_preset import SPECIAL_TOKENS, Gemma3Preset
from epd_engine.model.make_tokenizer import corpus_lines, pad_vocab

BYTE_TOKENS = [f"<0x{i:02X}>" for i in range(256)]


def with_gemma_pipeline(tokenizer: Tokenizer) -> Tokenizer:
    """transformers 5's ``GemmaTokenizer`` pipeline around ``tokenizer``'s model."""
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return tokenizer


def build_gemma3_tokenizer(preset: Gemma3Preset) -> Tokenizer:
    """Byte tokens, then BPE merges up to ``base_vocab_size``, then Gemma's special tokens at
    the preset's ids (in the model's vocabulary too, so ``<unk>`` is there); a ``<bos>`` is
    prepended on encode, as Gemma's tokenizer does."""
    base_vocab = preset.base_vocab_size
    # Trained word by word ("▁" starts a word, as in SentencePiece), so no merge spans two
    # words; encoding a whole string with those merges then splits at the same places.
    draft = Tokenizer(models.BPE(byte_fallback=True))
    draft.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never", split=True)
    trainer = trainers.BpeTrainer(
        vocab_size=base_vocab, special_tokens=BYTE_TOKENS, show_progress=False
    )
    draft.train_from_iterator(
        corpus_lines(num_synthetic_words=min(base_vocab, 40_000) * 4), trainer
    )
    model = json.loads(pad_vocab(draft, base_vocab).to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    vocab.update({token: preset.token_id(token) for token in SPECIAL_TOKENS})
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    bpe = models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    tokenizer = with_gemma_pipeline(Tokenizer(bpe))
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    )
    for token in SPECIAL_TOKENS:
        if tokenizer.token_to_id(token) != preset.token_id(token):
            raise AssertionError(f"{token} got id {tokenizer.token_to_id(token)}")
    bos = preset.token_id("<bos>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", bos)]
    )
    return tokenizer
