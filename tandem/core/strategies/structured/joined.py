"""Tokenizers whose decoder joins tokens with a separator (word-level ones): what
each token adds to the detokenized text, so the grammar matches that text.

A tokenizer with no decoder, or with a ``WordPiece`` decoder (the shipped demo
model's WordLevel one), decodes ``[cat, dog]`` to ``"cat dog"``: each token but
the first adds the separator and then itself (a WordPiece continuation, ``##s``,
adds itself without its prefix and without the separator). xgrammar matches the
concatenation of the token strings it is given, so those strings are what each
token adds after another (``" cat"``), and the grammar is the separator followed
by the spec (xgrammar's ``add_prefix_space`` is only a label: its matcher does not
read it): the first token's separator, which the
decoder never writes, is the grammar's and not the text's. The text then is the
grammar's text less its first character, which is a string of the spec.

Each token's string is what the tokenizer's own decoding adds for it after a
word, read after two different words (the same both times, or structured output
is refused: the text would depend on the neighbour), and a token that can begin
the text must decode alone to that string less the separator. WordPiece's
``cleanup`` (``" ."`` written ``"."``) is per token, so it is read like the rest.
Decoders that rewrite across tokens (CTC merges repeats; BPEDecoder writes the
last token's suffix differently) are refused at the door.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

# Decoders whose output is not a per-token function of each token and its neighbour.
_UNMAPPABLE = {
    "CTC": "it merges repeated tokens and drops its pad token",
    "BPEDecoder": "it writes a word's suffix as a space except after the last token",
}


@dataclass(frozen=True)
class Joined:
    """The decoder writes ``separator`` before each token but the first; a token
    starting with ``continuation`` (WordPiece's ``##``) joins the one before it."""

    separator: str = " "
    continuation: str | None = None


def joined_decoding(tokenizer) -> Joined | None:
    """The tokenizer's separator scheme; None where its decoder concatenates tokens
    (byte-level BPE, SentencePiece: xgrammar reads those itself). Raises
    ``ValueError`` naming the decoder where it cannot be mapped token by token."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None  # a slow tokenizer: xgrammar's own detection, as before
    decoder = json.loads(backend.to_str()).get("decoder")
    if decoder is None:
        return Joined()  # the tokenizers library joins tokens with a space when there is no decoder
    found = _walk(decoder)
    for kind, _ in found:
        if kind in _UNMAPPABLE:
            raise _unmappable(kind, _UNMAPPABLE[kind])
    kinds = [k for k, _ in found]
    if "WordPiece" not in kinds:
        return None
    if kinds != ["WordPiece"]:
        raise _unmappable(f"Sequence{kinds}", "a WordPiece decoder among others")
    return Joined(continuation=found[0][1].get("prefix", "##"))


def joined_vocab(tokenizer, vocab_size: int, joined: Joined, never_text: set[int]) -> list[str]:
    """Each id's text as the tokenizer decodes it after another token (``""`` for
    ``never_text`` ids and ids past the vocabulary: never allowed). Raises
    ``ValueError`` where that text depends on the token before it, or where a token
    at the start does not decode to its text less the separator."""
    ids = sorted(i for i in tokenizer.get_vocab().values() if 0 <= i < vocab_size and i not in never_text)
    backend = tokenizer.backend_tokenizer
    cont = joined.continuation
    words = [i for i in ids if not (cont and backend.id_to_token(i).startswith(cont))]
    if not words:
        raise ValueError("structured outputs: this tokenizer has no token that can begin a text")
    encoded = [""] * vocab_size
    for n, ref in enumerate(dict.fromkeys((words[0], words[-1]))):  # two different words before each token
        head = backend.decode([ref], skip_special_tokens=True)
        after = backend.decode_batch([[ref, i] for i in ids], skip_special_tokens=True)
        for i, got in zip(ids, after):
            piece = got[len(head):]
            if not got.startswith(head) or (n > 0 and piece != encoded[i]):
                raise _mismatch([ref, i], got, head + encoded[i] if n else head + "...")
            encoded[i] = piece
    sep = joined.separator
    starts = [i for i in ids if encoded[i].startswith(sep)]  # the grammar lets only these begin
    for i, got in zip(starts, backend.decode_batch([[i] for i in starts], skip_special_tokens=True)):
        if got != encoded[i][len(sep):]:
            raise _mismatch([i], got, encoded[i][len(sep):])
    return encoded


def _mismatch(ids: list[int], got: str, want: str) -> ValueError:
    return ValueError(f"structured outputs cannot follow this tokenizer's decoding: ids {ids} decode to {got!r}, "
                      f"not {want!r}: what a token writes depends on its neighbours, so a grammar over its "
                      "tokens would not match the text")


def _walk(decoder: dict) -> list[tuple[str, dict]]:
    if decoder.get("type") == "Sequence":
        return [d for sub in decoder.get("decoders", []) for d in _walk(sub)]
    return [(decoder.get("type"), decoder)]


def _unmappable(name: str, why: str) -> ValueError:
    return ValueError(f"structured outputs are not supported for this tokenizer: its decoder {name} cannot be "
                      f"mapped token by token ({why}), so a grammar over its tokens would not be the text")
