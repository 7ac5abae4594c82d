"""Words from timed tokens, as HF's ASR pipeline with ``return_timestamps="word"``.

Text tokens are grouped into words as openai-whisper and HF do: first into the
shortest runs that decode to whole characters; then (for languages written with
spaces) a run that starts with a space, is punctuation, or is special starts a new
word and any other run joins the word before; then leading punctuation
(``"'“¡¿([{-``) joins the next word and trailing punctuation the word before.

A token's span runs from the timestamp of the token before it (0 for an input's
first token) to its own, rounded to 10 ms; a word spans its first token's start
to its last token's end.
"""

from __future__ import annotations

PREPEND = "\"'“¡¿([{-"
APPEND = "\"'.。,，!！?？:：”)]}、"
PUNCTUATION = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
NO_SPACE_LANGUAGES = frozenset({"zh", "ja", "th", "lo", "my", "yue"})
_BAD = "\ufffd"


def _unicode_runs(tokenizer, tokens: list[int]) -> list[tuple[str, list[int]]]:
    """``(text, token indices)`` of the shortest token runs that decode to whole characters."""
    full = tokenizer.decode(tokens, decode_with_timestamps=True)
    runs, current, offset = [], [], 0
    for i in range(len(tokens)):
        current.append(i)
        text = tokenizer.decode([tokens[k] for k in current], decode_with_timestamps=True)
        bad = text.find(_BAD)
        if bad < 0 or offset + bad >= len(full) or full[offset + bad] == _BAD:
            runs.append((text, current))
            current = []
            offset += len(text)
    return runs


def _space_words(tokenizer, tokens: list[int]) -> list[tuple[str, list[int]]]:
    words: list[tuple[str, list[int]]] = []
    for text, idx in _unicode_runs(tokenizer, tokens):
        starts = tokens[idx[0]] >= tokenizer.eos_token_id or text.startswith(" ") or text.strip() in PUNCTUATION
        if starts or not words:
            words.append((text, list(idx)))
        else:
            words[-1] = (words[-1][0] + text, words[-1][1] + idx)
    return words


def _merge_punctuation(words: list[tuple[str, list[int]]]) -> list[tuple[str, list[int]]]:
    words = [list(w) for w in words]
    j = len(words) - 1
    for i in range(len(words) - 2, -1, -1):  # leading punctuation joins the word after
        if words[i][0].startswith(" ") and words[i][0].strip() in PREPEND:
            words[j] = [words[i][0] + words[j][0], words[i][1] + words[j][1]]
            words[i] = ["", []]
        else:
            j = i
    i = 0
    for j in range(1, len(words)):  # trailing punctuation joins the word before
        if not words[i][0].endswith(" ") and words[j][0] in APPEND:
            words[i] = [words[i][0] + words[j][0], words[i][1] + words[j][1]]
            words[j] = ["", []]
        else:
            i = j
    return [(text, idx) for text, idx in words if text and idx]


def group_words(tokenizer, tokens: list[int], language: str | None) -> list[tuple[str, list[int]]]:
    """``(word, indices into tokens)`` for text ``tokens``; ``language``: a code such
    as ``"en"`` (None: English)."""
    if language in NO_SPACE_LANGUAGES:
        words = _unicode_runs(tokenizer, tokens)
    else:
        words = _space_words(tokenizer, tokens)
    return _merge_punctuation(words)


def timed_words(tokenizer, tokens: list[int], spans: list[tuple[float, float]], language: str | None) -> list[dict]:
    """``[{"word", "start", "end"}]`` of text ``tokens`` whose ``(start, end)`` are ``spans``."""
    return [{"word": word, "start": round(spans[idx[0]][0], 2), "end": round(spans[idx[-1]][1], 2)}
            for word, idx in group_words(tokenizer, tokens, language)]
