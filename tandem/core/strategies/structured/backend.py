"""xgrammar, the one place tandem calls it: the tokenizer's vocabulary as xgrammar
sees it, compiling a spec, a matcher per sequence, filling and applying masks.

xgrammar is imported on first use (``tandem[structured]``), so tandem imports
and serves without it until a request asks for structured output.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from tandem.core.strategies.structured.bounds import DEFAULT_MAX_REPEAT, GrammarBoundsError, check_bounds
from tandem.core.strategies.structured.joined import joined_decoding, joined_vocab

if TYPE_CHECKING:
    import torch

    from tandem.core.structured_params import StructuredOutputsParams

INSTALL_HINT = "pip install 'tandem-engine[structured]'"
# Specs whose GrammarCost.jump is kept (more than the manager's cache of compiled grammars).
_JUMP_KEPT = 1024
# The engine option's default (EngineConfig.structured_outputs_max_whitespace): a run of
# whitespace between two JSON tokens is at most this many characters (0: any).
DEFAULT_MAX_WHITESPACE = 8


class GrammarCompileError(ValueError):
    """A request's spec could not be compiled (its ``error`` names the field and why)."""


def import_xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ImportError(
            f"structured outputs need the xgrammar package, which is not installed ({e}); "
            f"install the 'structured' extra: {INSTALL_HINT}"
        ) from e
    return xgrammar


class XgrammarBackend:
    """One per engine: the tokenizer info (built once, on first use) and a compiler.

    ``vocab_size`` is the LM head's: ids past the tokenizer's vocabulary are never
    allowed. The tokenizer's special tokens (``<s>``, ``<pad>``, ``<unk>``...) are
    never grammar text either: a detokenizer skips them, so text made of them would
    not be the text the grammar matched. ``stop_token_ids`` (the engine's EOS ids)
    are allowed exactly where the grammar is complete. A tokenizer whose decoder
    joins tokens with a separator (``joined``) is refused here when that cannot be
    mapped token by token, and its grammars are the separator then the spec."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], *,
                 max_repeat: int = DEFAULT_MAX_REPEAT, max_whitespace: int = DEFAULT_MAX_WHITESPACE) -> None:
        """``max_repeat``: the cost bounds' limit (``bounds.py``); ``max_whitespace``:
        whitespace characters at most between two JSON tokens (0: any amount)."""
        if tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer, and this engine has none")
        if not stop_token_ids:
            raise ValueError("structured outputs need an EOS token id, and the model config names none")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.joined = joined_decoding(tokenizer)  # raises ValueError at the door
        self.max_repeat, self.max_whitespace = max_repeat, max_whitespace
        self._lock = threading.Lock()
        self._jump: OrderedDict[tuple, str] = OrderedDict()  # spec -> GrammarCost.jump
        self._compiler = None
        self.tokenizer_info = None

    def compiler(self):
        """The compiler, made with the tokenizer info on first call (any thread)."""
        with self._lock:
            if self._compiler is None:
                xgr = import_xgrammar()
                self.tokenizer_info = build_tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids,
                                                           self.joined)
                self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=min(8, os.cpu_count() or 1))
            return self._compiler

    def compile(self, so: "StructuredOutputsParams"):
        """The compiled grammar of ``so``; raises ``GrammarCompileError`` naming the field.
        The grammar is checked against the cost bounds (``bounds.py``) before compiling."""
        compiler = self.compiler()
        kind = so.kind
        try:
            grammar = self.grammar(so)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError with the parser's message
            raise GrammarCompileError(f"StructuredOutputsParams.{kind}: cannot be compiled: {_cause(e)}") from e
        try:
            cost = check_bounds(str(grammar), self.max_repeat, lambda p: str(import_xgrammar().Grammar.from_regex(p)))
        except GrammarBoundsError as e:
            hint = ""
            if kind == "json" and "repetition count" in str(e):
                hint = ("; a schema's minLength, maxLength, minItems, maxItems, minProperties and maxProperties are "
                        "repetition counts")
            raise GrammarCompileError(f"StructuredOutputsParams.{kind}: refused before compiling: {e}{hint}") from None
        try:
            compiled = compiler.compile_grammar(grammar)
        except Exception as e:  # noqa: BLE001
            raise GrammarCompileError(f"StructuredOutputsParams.{kind}: cannot be compiled: {_cause(e)}") from e
        with self._lock:
            self._jump[so.cache_key] = cost.jump
            while len(self._jump) > _JUMP_KEPT:
                self._jump.popitem(last=False)
        return compiled

    def jump_mode(self, so: "StructuredOutputsParams") -> str:
        """How ``so``'s compiled grammar's jump-forward searches run (``GrammarCost.jump``:
        "inline", "budget" or "off"); "off" when not known."""
        with self._lock:
            return self._jump.get(so.cache_key, "off")

    def grammar(self, so: "StructuredOutputsParams"):
        """``so`` as an xgrammar ``Grammar`` (not compiled). A tokenizer that joins its
        tokens with a separator gets the separator then the spec: the first token's
        separator is written by no decoder, so it is the grammar's, not the text's."""
        xgr, kind, spec = import_xgrammar(), so.kind, so.spec
        if kind in ("json", "json_object"):
            ws = not so.disable_any_whitespace
            kw = {"any_whitespace": ws}
            if ws and self.max_whitespace > 0:
                kw["max_whitespace_cnt"] = self.max_whitespace
            if kind == "json":
                g = xgr.Grammar.from_json_schema(spec, **kw)
            else:  # OpenAI's: any JSON object
                g = xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, **kw)
        elif kind == "regex":
            g = xgr.Grammar.from_regex(spec)
        else:
            g = xgr.Grammar.from_ebnf(choice_grammar(spec) if kind == "choice" else spec)
        if self.joined is not None:
            g = xgr.Grammar.concat(xgr.Grammar.from_ebnf("root ::= " + json.dumps(self.joined.separator)), g)
        return g

    def matcher(self, compiled):
        return import_xgrammar().GrammarMatcher(compiled)

    def token_bytes(self) -> tuple[list[bytes], set[int]]:
        """Each id's text as the grammar matches it, and the ids that are never text
        (special and stop tokens, empty ones, ids past the tokenizer's vocabulary).
        After the first compile (the vocabulary table is built with the compiler)."""
        info = self.tokenizer_info
        if info is None:
            raise RuntimeError("the vocabulary table is built with the first compile")
        strings = list(info.decoded_vocab)[: self.vocab_size]
        strings += [b""] * (self.vocab_size - len(strings))
        never = set(self.stop_token_ids) | set(getattr(self.tokenizer, "all_special_ids", ()) or ())
        never |= {i for i, s in enumerate(strings) if not s}
        return strings, never

    def num_allowed(self, matcher) -> int:
        """How many ids ``matcher`` allows next (special tokens never; EOS where the
        grammar is complete). One row's mask, so only for explaining a dead end."""
        import torch

        mask = import_xgrammar().allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(mask, 0)
        bits = (mask[0].unsqueeze(-1) >> torch.arange(32, dtype=mask.dtype)) & 1  # [words, 32], id = 32 * word + bit
        return int(bits.flatten()[: self.vocab_size].sum())


def build_tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: list[int], joined=None):
    """xgrammar's view of the vocabulary, ``vocab_size`` ids (the LM head's), with the
    tokenizer's special tokens other than the stop tokens made empty (so never allowed).
    ``joined`` (a ``Joined``): each token is what it adds to the text after another."""
    xgr = import_xgrammar()
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    for idx, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            special.add(idx)
    if joined is not None:
        encoded = joined_vocab(tokenizer, vocab_size, joined, special | set(stop_token_ids))
        for idx, token in ((i, tokenizer.convert_ids_to_tokens(i)) for i in stop_token_ids):
            if 0 <= idx < vocab_size:
                encoded[idx] = token
        return xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    encoded = [""] * vocab_size
    for token, idx in tokenizer.get_vocab().items():
        if idx < vocab_size:
            encoded[idx] = token
    for idx in special - set(stop_token_ids):
        if 0 <= idx < vocab_size:
            encoded[idx] = ""
    return xgr.TokenizerInfo(encoded, detected.vocab_type, vocab_size=vocab_size, stop_token_ids=stop_token_ids,
                             add_prefix_space=detected.add_prefix_space)


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (each a quoted literal,
    JSON's escapes being EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _cause(e: Exception) -> str:
    # xgrammar prefixes its messages with "[time] /path/file.cc:line: "; keep the message.
    text = str(e).strip()
    head, sep, rest = text.partition(": ")
    if sep and head.startswith("[") and ".cc:" in head:
        return rest.strip()
    return text


def new_bitmask(rows: int, vocab_size: int) -> "torch.Tensor":
    """``[rows, ceil(vocab / 32)]`` int32, every token allowed."""
    return import_xgrammar().allocate_token_bitmask(rows, vocab_size)


def fill_bitmask(matchers: list, bitmask: "torch.Tensor", rows: list[int], batch: Any) -> None:
    """Each matcher's next-token mask into its row (``batch``: an xgrammar
    ``BatchGrammarMatcher``, one C++ call for all rows; None: one call per row)."""
    if batch is not None:
        batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        return
    for matcher, row in zip(matchers, rows):
        matcher.fill_next_token_bitmask(bitmask, row)


def apply_bitmask(logits: "torch.Tensor", bitmask: "torch.Tensor", rows: list[int]) -> None:
    """Disallowed tokens of ``rows`` to -inf, in place (xgrammar's CUDA kernel on a GPU)."""
    xgr = import_xgrammar()
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)
