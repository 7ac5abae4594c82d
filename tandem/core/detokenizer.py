"""Incremental detokenization: each sequence's text grown a token at a time, one
sequence at a time (``IncrementalDetokenizer``) or every sequence a step advanced at
once (``BatchDetokenizer``, what the ``OutputProcessor`` uses with a fast tokenizer).

The batched path follows the tokenizers library's ``DecodeStream.step`` token for token
(the same windows, the same text; ``tests/core/test_detokenizer.py`` compares the two on
random sequences), but decodes the windows of all the step's sequences in one
``decode_batch`` call per token position. That call runs in Rust without the GIL (the
engine thread steps meanwhile), where a ``DecodeStream.step`` per sequence holds it for
two decodes. A window of a single token is looked up instead (its text never changes):
in steady decoding the window a sequence re-decodes after emitting text is its last
token alone, so a token costs one decode, not two.
"""

from __future__ import annotations

from collections.abc import Collection

REPLACEMENT = "\ufffd"  # what a decode ends with when its last bytes are an incomplete character
# Single-token texts kept per skip_special_tokens value: a vocabulary's worth for usual ones.
MAX_CACHED_TOKENS = 1 << 18


class IncrementalDetokenizer:
    """One sequence's output text, grown a token at a time.

    Fast tokenizers use the tokenizers library's ``DecodeStream``, which keeps
    just enough of the tail to emit complete characters. Other tokenizers fall
    back to decoding the whole output and taking the new suffix."""

    def __init__(self, tokenizer, skip_special_tokens: bool, non_text_token_ids: Collection[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.non_text = non_text_token_ids
        self.text = ""
        self._ids: list[int] = []
        backend = getattr(tokenizer, "_tokenizer", None)
        self._stream = None
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._backend = backend
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Feed new tokens; returns the text they complete (possibly empty)."""
        if self.non_text:
            token_ids = [t for t in token_ids if t not in self.non_text]
        if self._stream is not None:
            pieces = [self._stream.step(self._backend, t) for t in token_ids]
            new = "".join(p for p in pieces if p)
        else:
            self._ids.extend(token_ids)
            full = self.tokenizer.decode(self._ids, skip_special_tokens=self.skip_special_tokens)
            if not full.startswith(self.text):  # the tokenizer revised earlier text: start over
                self.text = ""
            new = full[len(self.text):]
        self.text += new
        return new


class DetokenizerStream:
    """One sequence followed by a :class:`BatchDetokenizer`: ``DecodeStream``'s state
    (the window ``ids``, its ``prefix`` text and ``prefix_index``) and ``text``, all the
    text emitted. ``window`` is the decode of ``ids`` when known (None: not yet decoded,
    as after text was emitted, when ``DecodeStream`` decodes it at once and this stream
    on the next token, beside that token's window)."""

    __slots__ = ("owner", "skip_special_tokens", "non_text", "text", "ids", "prefix", "prefix_index", "window")

    def __init__(self, owner: BatchDetokenizer, skip_special_tokens: bool,
                 non_text_token_ids: Collection[int] = ()) -> None:
        self.owner = owner
        self.skip_special_tokens = bool(skip_special_tokens)
        self.non_text = non_text_token_ids
        self.text = ""
        self.ids: list[int] = []
        self.prefix = ""
        self.prefix_index = 0
        self.window: str | None = ""

    def add(self, token_ids: list[int]) -> str:
        """Feed new tokens (a batch of one); returns the text they complete."""
        before = len(self.text)
        failed = self.owner.add([(self, token_ids)])
        if failed:
            raise failed[self]
        return self.text[before:]


class InvalidPrefixError(ValueError):
    """The decode of a window no longer starts with its prefix's text: ``DecodeStream``'s
    ``InvalidPrefix`` error, with its message."""


class BatchDetokenizer:
    """Incremental detokenization of many sequences at once with one fast tokenizer
    (one that has a tokenizers-library backend: :meth:`supports`)."""

    def __init__(self, tokenizer) -> None:
        self.backend = tokenizer._tokenizer
        self._single: tuple[dict[int, str], dict[int, str]] = ({}, {})  # by skip_special_tokens

    @staticmethod
    def supports(tokenizer) -> bool:
        return getattr(tokenizer, "_tokenizer", None) is not None and hasattr(tokenizer._tokenizer, "decode_batch")

    def stream(self, skip_special_tokens: bool, non_text_token_ids: Collection[int] = ()) -> DetokenizerStream:
        return DetokenizerStream(self, skip_special_tokens, non_text_token_ids)

    def add(self, items: list[tuple[DetokenizerStream, list[int]]]) -> dict[DetokenizerStream, Exception]:
        """Feed each stream its new tokens (each stream at most once); their ``text``
        grows by what the tokens complete. Returns the streams that failed, with why
        (their state is then undefined: the caller drops them); the others are fed."""
        failed: dict[DetokenizerStream, Exception] = {}
        work = []
        for s, ids in items:
            if s.non_text:
                ids = [t for t in ids if t not in s.non_text]
            if ids:
                work.append((s, ids))
        k = 0
        while work:  # token position by token position: DecodeStream takes one at a time
            self._round([(s, ids[k]) for s, ids in work], failed)
            k += 1
            work = [(s, ids) for s, ids in work if len(ids) > k and s not in failed]
        return failed

    def _round(self, pairs: list[tuple[DetokenizerStream, int]], failed: dict) -> None:
        try:
            self._step(pairs, failed)
        except Exception as e:  # noqa: BLE001 - a batch decode failed (no stream changed): find whose it was
            if len(pairs) == 1:
                failed[pairs[0][0]] = e
                return
            for pair in pairs:
                self._round([pair], failed)

    def _step(self, pairs: list[tuple[DetokenizerStream, int]], failed: dict) -> None:
        """One ``DecodeStream.step`` for each pair's stream: every decode it needs first
        (planned without changing any stream, so a failed batch can be retried), then
        the steps (a stream that fails there fails alone)."""
        single = self._single
        seqs: tuple[list[list[int]], list[list[int]]] = ([], [])
        plan = []
        for s, t in pairs:
            skip = s.skip_special_tokens
            ids = s.ids
            # DecodeStream first re-decodes the window when its prefix is stale or empty.
            if s.window is not None:
                a = s.window
            elif len(ids) == 1 and ids[0] in single[skip]:
                a = single[skip][ids[0]]
            else:
                a = len(seqs[skip])
                seqs[skip].append(ids)
            if len(ids) == 0 and t in single[skip]:
                b = single[skip][t]
            else:
                b = len(seqs[skip])
                seqs[skip].append(ids + [t])
            plan.append((s, t, a, b))
        texts = (self.backend.decode_batch(seqs[0], skip_special_tokens=False) if seqs[0] else (),
                 self.backend.decode_batch(seqs[1], skip_special_tokens=True) if seqs[1] else ())
        for s, t, a, b in plan:
            try:
                skip = s.skip_special_tokens
                out, ids = texts[skip], s.ids
                if a.__class__ is int:
                    a = out[a]
                    if len(ids) == 1 and len(single[skip]) < MAX_CACHED_TOKENS:
                        single[skip][ids[0]] = a
                if b.__class__ is int:
                    b = out[b]
                    if not ids and len(single[skip]) < MAX_CACHED_TOKENS:
                        single[skip][t] = b
                _decode_step(s, t, a, b)
            except Exception as e:  # noqa: BLE001 - this sequence alone
                failed[s] = e


def _decode_step(s: DetokenizerStream, t: int, window: str, string: str) -> None:
    """``tokenizers::tokenizer::step_decode_stream`` for one token ``t``, given the decode
    of the window before it (``window``) and with it (``string``)."""
    ids = s.ids
    if s.window is None:  # the prefix DecodeStream computed after its last emission
        s.prefix = window
    if not s.prefix and ids and not window.endswith(REPLACEMENT):
        s.prefix = window
        s.prefix_index = len(ids)
    ids.append(t)
    prefix = s.prefix
    # DecodeStream compares UTF-8 lengths; for a string that starts with the prefix,
    # the character lengths say the same.
    if string.startswith(prefix):
        if len(string) > len(prefix) and not string.endswith(REPLACEMENT):
            s.text += string[len(prefix):]
            n = len(ids) - s.prefix_index
            del ids[:s.prefix_index]
            s.prefix_index = n
            s.window = None
            return
    elif not string.endswith(REPLACEMENT) and len(string.encode()) > len(prefix.encode()):
        raise InvalidPrefixError(f"Invalid prefix encountered while decoding stream. Token ID: {t}, Expected "
                                 f"prefix: '{prefix}', Actual string: '{string}'")
    s.window = string
