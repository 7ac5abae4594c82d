"""Structured output on tokenizers whose decoder joins tokens with a space (word-level).

Oracle: the text the engine's own detokenizer (``IncrementalDetokenizer``) makes of
the tokens a grammar let through, checked with ``re.fullmatch``, ``jsonschema`` or
membership. Random walks over each grammar's masks (seeded) stand in for a model:
whatever a walk ends with EOS must follow the spec."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from tandem import StructuredOutputsParams as SO  # noqa: E402
from tandem.core.output_processor import IncrementalDetokenizer  # noqa: E402
from tandem.core.strategies.structured.backend import XgrammarBackend  # noqa: E402

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
EOS = 2
WORDS = ["cat", "dog", "big", "a", "do", "ca", "##t", "##s", "[", "]", "{", "}", '"', ":", ",", ".", "1", "2", "12"]
HEAD_PADDING = 5


def word_tokenizer(decoder):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if decoder is not None:
        tok.decoder = decoder
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def decoders_under_test():
    from tokenizers import decoders

    return {
        "wordpiece": decoders.WordPiece(prefix="##", cleanup=False),
        "wordpiece-cleanup": decoders.WordPiece(prefix="##", cleanup=True),  # " ," written ","
        "none": None,  # the tokenizers library joins with spaces
    }


def allowed(matcher, vocab_size: int) -> list[int]:
    mask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(mask, 0)
    bits = (mask[0].unsqueeze(-1) >> torch.arange(32, dtype=mask.dtype)) & 1  # [words, 32]
    return bits.flatten()[:vocab_size].nonzero().flatten().tolist()


def walk(backend, compiled, rng: random.Random, max_len: int = 12):
    """Random tokens the grammar allows until EOS (taken when allowed, half the time);
    (ids, False) at a dead end (xgrammar does not look ahead: 'do' may begin 'dog')."""
    matcher, ids = backend.matcher(compiled), []
    for _ in range(max_len):
        options = allowed(matcher, backend.vocab_size)
        if not options:
            return ids, False
        if EOS in options and (len(options) == 1 or rng.random() < 0.5):
            return ids, True
        choice = rng.choice([t for t in options if t != EOS] or options)
        assert matcher.accept_token(choice)
        ids.append(choice)
    return ids, False


def text_of(tokenizer, ids: list[int]) -> str:
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    for t in ids:  # a token at a time, as the engine streams
        detok.add([t])
    return detok.text


SPECS = {
    "regex words": (SO(regex="(cat|dog)+"), lambda t: re.fullmatch("(cat|dog)+", t)),
    "regex spaced": (SO(regex="(cat|dog)( (cat|dog))*"), lambda t: re.fullmatch("(cat|dog)( (cat|dog))*", t)),
    "regex glued": (SO(regex="cats?|dogs"), lambda t: re.fullmatch("cats?|dogs", t)),
    "choice": (SO(choice=["big cat", "a dog", "cat", "a cat."]), lambda t: t in ("big cat", "a dog", "cat", "a cat.")),
    "json array": (SO(json={"type": "array", "items": {"type": "integer"}, "minItems": 1}),
                   lambda t: jsonschema.validate(json.loads(t), {"type": "array", "items": {"type": "integer"},
                                                                "minItems": 1}) is None),
    "json object": (SO(json={"type": "object", "additionalProperties": {"type": "string"}}),
                    lambda t: jsonschema.validate(json.loads(t), {"type": "object", "additionalProperties":
                                                                  {"type": "string"}}) is None),
}


@pytest.mark.parametrize("decoder", ["wordpiece", "wordpiece-cleanup", "none"])
@pytest.mark.parametrize("spec", list(SPECS))
def test_every_finished_walk_decodes_to_text_that_follows_the_spec(decoder, spec):
    tok = word_tokenizer(decoders_under_test()[decoder])
    vocab_size = len(tok) + HEAD_PADDING
    backend = XgrammarBackend(tok, vocab_size, [EOS])
    so, follows = SPECS[spec]
    compiled = backend.compile(so)
    rng = random.Random(f"{decoder}/{spec}")
    finished = []
    for _ in range(60):
        ids, done = walk(backend, compiled, rng)
        if done:
            text = text_of(tok, ids)
            assert follows(text), (ids, text)
            finished.append(text)
    assert finished, "no walk finished: the check above never ran"
    if spec == "regex spaced" or spec == "choice":
        assert any(" " in t for t in finished), finished  # several words, as the spec asks, can be written


def test_the_spaced_words_of_a_choice_can_all_be_written():
    """Every member is reachable: a word-level vocabulary writes 'big cat' as two tokens."""
    tok = word_tokenizer(decoders_under_test()["wordpiece"])
    backend = XgrammarBackend(tok, len(tok), [EOS])
    compiled = backend.compile(SO(choice=["big cat", "a dog"]))
    for member in ("big cat", "a dog"):
        matcher = backend.matcher(compiled)
        ids = tok.convert_tokens_to_ids(member.split())
        assert all(matcher.accept_token(t) for t in ids) and matcher.accept_token(EOS)
        assert text_of(tok, ids) == member


def test_a_decoder_that_cannot_be_mapped_token_by_token_is_refused_at_the_door():
    from tokenizers import decoders

    for decoder, name in ((decoders.CTC(), "CTC"), (decoders.BPEDecoder(), "BPEDecoder"),
                          (decoders.Sequence([decoders.WordPiece(), decoders.Strip()]), "WordPiece")):
        with pytest.raises(ValueError, match=f"not supported for this tokenizer: its decoder .*{name}"):
            XgrammarBackend(word_tokenizer(decoder), len(SPECIALS + WORDS), [EOS])


def test_concatenating_decoders_keep_xgrammars_own_reading():
    """Byte-level BPE and SentencePiece's Metaspace concatenate tokens: no separator."""
    from tokenizers import decoders

    from helpers import make_byte_tokenizer

    assert XgrammarBackend(make_byte_tokenizer(), 300, [EOS]).joined is None
    assert XgrammarBackend(word_tokenizer(decoders.Metaspace()), len(SPECIALS + WORDS), [EOS]).joined is None
