"""Per-request sampling settings, checked and frozen at construction."""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from tandem.core.param_errors import type_error, value_error
from tandem.core.structured_params import StructuredOutputsParams
from tandem.core.text_checks import check_unicode

_GREEDY_EPS = 1e-5
# torch.Generator.manual_seed reads the seed as a signed or an unsigned 64-bit
# integer and raises a bare "Overflow when unpacking long long" outside this.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1

# Ranges that keep every value finite in the float32 arithmetic it enters.
_F32_MAX = 3.4028234663852886e38
_F32_TINY = 1.1754943508222875e-38  # smallest normal: below it top_p rounds towards 0
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's range
REPETITION_PENALTY_RANGE = (0.01, 100.0)
# len ** length_penalty stays a normal float32 for every length up to 4096 (2**12):
# 2**(12 * 10) = 2**120 < 2**128, and 2**-120 > 2**-126.
LENGTH_PENALTY_RANGE = (-10.0, 10.0)

# Caps on list-valued fields, so one request's processing cost stays bounded
# (docs/generation.md, "Limits").
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_TOKEN_ID_LIST = 65_536  # stop_token_ids, suppress_tokens, begin_suppress_tokens, forced_eos_token_id
MAX_ALLOWED_TOKEN_IDS = 1 << 18
MAX_LOGIT_BIAS = 4096
MAX_BAD_WORDS = 4096  # sequences
MAX_BAD_WORD_TOKENS = 65_536  # tokens over all sequences
# A stop_token_ids list of thousands of ids should not become a page-long error.
_MAX_SHOWN = 200


def param(default, help: str, *, api: object = None, api_name: str | None = None, cli: bool | str = False):
    """A ``SamplingParams`` field with what the entry points make of it: ``help`` (the server's
    field description, the flag's help, docs/generation.md's table); ``api``: the JSON type the
    server's request model takes (None: not on the server), under ``api_name`` (default: the
    field's name) where OpenAI spells it otherwise; ``cli``: a flag of ``tandem generate`` (True:
    ``--name-with-dashes``, or the flag to use)."""
    return field(default=default, metadata={"help": help, "api": api, "api_name": api_name or None, "cli": cli})


class RequestOutputKind(enum.IntEnum):
    """What ``LLMEngine.step()`` returns for a request that advanced."""

    CUMULATIVE = 0  # everything generated so far, every step
    DELTA = 1  # only the tokens and text new since the last output
    FINAL_ONLY = 2  # nothing until the request finishes


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request.

    **Decoding.** ``temperature == 0`` is greedy decoding; ``num_beams > 1`` is
    beam search with HF ``generate``'s semantics (``length_penalty``,
    ``early_stopping`` True / False / ``"never"``), and then ``n`` is HF's
    ``num_return_sequences``: the ``n`` best finished beams, best first, each
    with its beam score as ``cumulative_logprob``. ``max_tokens`` counts
    generated tokens (None: as many as the decoder positions allow);
    ``max_length`` and ``min_length`` count the whole decoder sequence, decoder
    prompt included, as HF does. ``min_tokens`` (HF ``min_new_tokens``)
    suppresses EOS and ``stop_token_ids`` until that many tokens exist.
    ``logprobs=k`` returns the top-k log-probabilities (plus the chosen token's)
    for every step, taken after the logits processors. ``top_k`` of 0 or -1
    means off (stored as -1). ``output_kind`` says what ``LLMEngine.step()``
    returns for the request as it advances (``LLM.generate`` always returns the
    final output; beam search returns only when it finishes).

    **Logits processors** (HF semantics, applied in this order, and only to the
    requests that set them): ``allowed_token_ids``, ``logit_bias`` (OpenAI:
    token id -> added bias), ``repetition_penalty`` (over the decoder prompt
    and output), ``presence_penalty`` / ``frequency_penalty`` (OpenAI, over the
    output), ``no_repeat_ngram_size``, ``bad_words_ids`` (token sequences, of
    any length), ``min_length`` / ``min_tokens``, ``forced_bos_token_id``,
    ``forced_eos_token_id``, ``suppress_tokens``, ``begin_suppress_tokens``,
    then the user's ``logits_processors`` (vLLM's signature: ``fn(output_ids,
    logits)`` or ``fn(prompt_ids, output_ids, logits)``, returning the logits).

    **Structured output.** ``structured_outputs=StructuredOutputsParams(json=...)``
    (or ``regex``, ``choice``, ``grammar``, ``json_object``) constrains every
    token to the grammar, before the logits processors; EOS is allowed only where
    the grammar is complete. Not with beam search. Needs the ``structured`` extra
    (xgrammar).

    **Defaults from the checkpoint.** The engine fills every field the caller
    did not pass from the checkpoint's generation config, as HF ``generate``
    does (``LLM.get_default_sampling_params()`` shows the result); fields
    passed explicitly always win. ``explicit_fields`` lists them.

    Every field is checked here, type before range: a wrong type raises
    ``TypeError`` and a wrong value ``ValueError``, both worded
    ``SamplingParams.<field>=<value>: <why>``. Limits that depend on the model
    (token ids against the vocabulary, lengths against the decoder positions)
    are checked by the engine per request.

    The object is frozen, so one instance can be shared by many requests.
    NumPy integers and floats are converted to ``int`` / ``float``; lists are
    stored as tuples (``logit_bias`` as sorted ``(token_id, bias)`` pairs),
    copies the caller cannot mutate, which also keeps instances hashable. Use
    :meth:`replace` (not ``dataclasses.replace``) to derive a changed copy that
    keeps track of which fields were set.
    """

    # Each field's metadata (``param``) is the one declaration the server's request model, the
    # ``tandem generate`` flags and docs/generation.md's "Request fields" table are made from.
    n: int = param(1, "completions to return for the prompt (with beams: the n best beams)", api=int)
    temperature: float = param(1.0, "divides the logits before sampling; 0 is greedy", api=float, cli=True)
    top_k: int = param(-1, "sample from the k likeliest tokens; -1 or 0 is off", api=int, cli=True)
    top_p: float = param(1.0, "sample from the smallest set of tokens holding this much probability; 1 is off",
                         api=float, cli=True)
    min_p: float = param(0.0, "drop tokens less likely than min_p times the likeliest; 0 is off", api=float, cli=True)
    seed: int | None = param(None, "the request's own sampling seed: the same samples whatever else runs, with "
                             "or without speculative decoding (none: the engine's random stream)", api=int,
                             cli="--request-seed")
    max_tokens: int | None = param(16, "tokens to generate at most (none: as many as the decoder positions allow)",
                                   api=int, cli=True)
    min_tokens: int = param(0, "EOS and stop_token_ids are banned until this many tokens are generated",
                            api=int, cli=True)
    stop: str | Sequence[str] | None = param(None, "strings that end the output where they appear (not included)",
                                             api=str | list[str], cli=True)
    stop_token_ids: Sequence[int] | None = param(None, "token ids that end the output (included)", api=list[int],
                                                 cli=True)
    ignore_eos: bool = param(False, "keep generating past EOS", api=bool, cli=True)
    logprobs: int | None = param(None, "log-probabilities of the k likeliest tokens (and the chosen one) at each "
                                 "step (none: not computed)", api=int)
    skip_special_tokens: bool = param(True, "leave special tokens out of the text", api=bool, cli=True)
    output_kind: RequestOutputKind = param(RequestOutputKind.CUMULATIVE,
                                           "what LLMEngine.step() returns as the request advances")
    # HF-style lengths over the whole decoder sequence (prompt included).
    max_length: int | None = param(None, "HF's max_length: the whole decoder sequence, prompt included")
    min_length: int = param(0, "HF's min_length: EOS banned until the decoder sequence is this long")
    # Logits processors.
    repetition_penalty: float = param(1.0, "HF's: a token already in the decoder sequence has its score divided "
                                      "by this (multiplied when negative); 1 is off", api=float, cli=True)
    presence_penalty: float = param(0.0, "OpenAI's: subtracted from the score of every token already generated",
                                    api=float, cli=True)
    frequency_penalty: float = param(0.0, "OpenAI's: subtracted once per time a token was already generated",
                                     api=float, cli=True)
    no_repeat_ngram_size: int = param(0, "HF's: no n-gram of this size occurs twice; 0 is off", api=int, cli=True)
    bad_words_ids: Sequence[Sequence[int]] | None = param(None, "HF's: token sequences never produced",
                                                          api=list[list[int]], cli=True)
    forced_bos_token_id: int | None = param(None, "HF's: the token forced after a one-token decoder prompt")
    forced_eos_token_id: int | Sequence[int] | None = param(None, "HF's: the token(s) forced where the length ends")
    suppress_tokens: Sequence[int] | None = param(None, "HF's: token ids banned at every step")
    begin_suppress_tokens: Sequence[int] | None = param(None, "HF's: token ids banned at the first generated position")
    allowed_token_ids: Sequence[int] | None = param(None, "only these token ids may be generated", api=list[int],
                                                    cli=True)
    logit_bias: Mapping[int, float] | None = param(None, "OpenAI's: token id -> bias added to its score, in "
                                                   "[-100, 100]", api=dict[str, float], cli=True)
    logits_processors: Sequence[Callable] | None = param(None, "callables fn(output_ids, logits) or "
                                                         "fn(prompt_ids, output_ids, logits), run last")
    # Beam search.
    num_beams: int = param(1, "beam search with this many beams; 1 is no beams", api=int, cli=True)
    length_penalty: float = param(1.0, "beam search: a beam's score is its log-probability over its length to "
                                  "this power", api=float, cli=True)
    early_stopping: bool | str = param(False, "beam search: True, False or 'never', HF's")
    # Constrained output (docs/structured_output.md): a JSON schema, regex, choice or grammar.
    structured_outputs: StructuredOutputsParams | None = param(None, "a JSON schema, regex, choice or grammar "
                                                               "every token must follow (docs/structured_output.md)")
    # Derived from ``stop``; left out of eq/hash because ``stop`` already decides it.
    stop_strings: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        if not hasattr(self, "_explicit"):  # built by dataclasses machinery, not __init__
            put("_explicit", frozenset())
        put("n", _int("n", self.n, 1))
        put("temperature", _real("temperature", self.temperature, "a real number in [0, 3.4e38] (float32's range)",
                                 lambda x: 0 <= x <= _F32_MAX))
        top_k = _int("top_k", self.top_k, -1, "-1 or 0 (off), or an integer >= 1")
        put("top_k", -1 if top_k == 0 else top_k)
        put("top_p", _real("top_p", self.top_p, "a real number in [1.2e-38, 1] (below float32's smallest normal "
                           "it rounds towards 0)", lambda x: _F32_TINY <= x <= 1))
        put("min_p", _real("min_p", self.min_p, "a real number in [0, 1]", lambda x: 0 <= x <= 1))
        if self.seed is not None:
            seed = _int("seed", self.seed, None, "None or an integer")
            if not _SEED_MIN <= seed <= _SEED_MAX:
                raise _value_error("seed", self.seed, "must be in [-2**63, 2**64 - 1], the range torch seeds take")
            put("seed", seed)
        if self.max_tokens is not None:
            put("max_tokens", _int("max_tokens", self.max_tokens, 1, "None or an integer >= 1"))
        put("min_tokens", _int("min_tokens", self.min_tokens, 0))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _value_error("min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            put("logprobs", _int("logprobs", self.logprobs, 0, "None or an integer >= 0"))
        put("ignore_eos", _bool("ignore_eos", self.ignore_eos))
        put("skip_special_tokens", _bool("skip_special_tokens", self.skip_special_tokens))
        if not isinstance(self.output_kind, RequestOutputKind):
            kinds = ", ".join(f"RequestOutputKind.{k.name}" for k in RequestOutputKind)
            raise TypeError(f"SamplingParams.output_kind={self.output_kind!r}: must be one of {kinds}")

        stop_strings = _stop_strings(self.stop)
        if len(stop_strings) > MAX_STOP_STRINGS:
            raise _value_error("stop", f"<{len(stop_strings)} strings>", f"must hold at most {MAX_STOP_STRINGS} strings")
        long = [len(x) for x in stop_strings if len(x) > MAX_STOP_STRING_CHARS]
        if long:
            raise _value_error("stop", f"<a string of {long[0]} characters>",
                               f"each string must be at most {MAX_STOP_STRING_CHARS} characters")
        if not isinstance(self.stop, str) and self.stop is not None:
            put("stop", stop_strings)
        put("stop_strings", stop_strings)
        put("stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids))

        if self.max_length is not None:
            put("max_length", _int("max_length", self.max_length, 1, "None or an integer >= 1"))
        put("min_length", _int("min_length", self.min_length, 0))
        lo, hi = REPETITION_PENALTY_RANGE
        put(
            "repetition_penalty",
            _real("repetition_penalty", self.repetition_penalty, f"a real number in [{lo}, {hi}] (1 is off)",
                  lambda x: lo <= x <= hi),
        )
        put("presence_penalty", _real("presence_penalty", self.presence_penalty, "a real number in [-2, 2]", lambda x: -2 <= x <= 2))
        put(
            "frequency_penalty",
            _real("frequency_penalty", self.frequency_penalty, "a real number in [-2, 2]", lambda x: -2 <= x <= 2),
        )
        put("no_repeat_ngram_size", _int("no_repeat_ngram_size", self.no_repeat_ngram_size, 0))
        put("bad_words_ids", _token_seqs("bad_words_ids", self.bad_words_ids))
        if self.forced_bos_token_id is not None:
            put("forced_bos_token_id", _int("forced_bos_token_id", self.forced_bos_token_id, 0, "None or a token id >= 0"))
        forced_eos = self.forced_eos_token_id
        if forced_eos is not None:
            ids = _token_ids("forced_eos_token_id", [forced_eos] if _is_int(forced_eos) else forced_eos)
            if not ids:
                raise _value_error("forced_eos_token_id", forced_eos, "must name at least one token id")
            put("forced_eos_token_id", ids)
        put("suppress_tokens", _token_ids("suppress_tokens", self.suppress_tokens))
        put("begin_suppress_tokens", _token_ids("begin_suppress_tokens", self.begin_suppress_tokens))
        if self.allowed_token_ids is not None:
            allowed = _token_ids("allowed_token_ids", self.allowed_token_ids)
            if not allowed:
                raise _value_error("allowed_token_ids", self.allowed_token_ids, "must not be empty (None allows every token)")
            put("allowed_token_ids", allowed)
        put("logit_bias", _logit_bias(self.logit_bias))
        put("logits_processors", _callables("logits_processors", self.logits_processors))

        put("num_beams", _int("num_beams", self.num_beams, 1))
        lo, hi = LENGTH_PENALTY_RANGE
        put("length_penalty", _real("length_penalty", self.length_penalty,
                                    f"a real number in [{lo}, {hi}] (length ** length_penalty must stay finite)",
                                    lambda x: lo <= x <= hi))
        if self.early_stopping not in (True, False, "never") or isinstance(self.early_stopping, (int, float)) and not isinstance(self.early_stopping, bool):
            raise _value_error("early_stopping", self.early_stopping, "must be True, False or 'never'")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise _type_error("structured_outputs", self.structured_outputs, "None or a StructuredOutputsParams")
        self._check_sizes()
        if self.num_beams > 1:
            # Here only against fields the caller set: the others may still come
            # from the checkpoint's defaults (the engine checks the merged result).
            self.check_beam_search(self.explicit_fields)

    def _check_sizes(self) -> None:
        caps = [("stop_token_ids", MAX_TOKEN_ID_LIST), ("suppress_tokens", MAX_TOKEN_ID_LIST),
                ("begin_suppress_tokens", MAX_TOKEN_ID_LIST), ("forced_eos_token_id", MAX_TOKEN_ID_LIST),
                ("allowed_token_ids", MAX_ALLOWED_TOKEN_IDS), ("logit_bias", MAX_LOGIT_BIAS),
                ("bad_words_ids", MAX_BAD_WORDS)]
        for name, cap in caps:
            value = getattr(self, name)
            if value is not None and len(value) > cap:
                raise _value_error(name, f"<{len(value)} entries>", f"must hold at most {cap} entries")
        total = sum(len(w) for w in self.bad_words_ids)
        if total > MAX_BAD_WORD_TOKENS:
            raise _value_error("bad_words_ids", f"<{total} tokens>", f"must hold at most {MAX_BAD_WORD_TOKENS} tokens in all")

    def check_beam_search(self, fields: frozenset[str] | None = None) -> None:
        """Raise ``ValueError`` for settings beam search cannot serve, among ``fields``
        (all when None), each conflict naming both values."""
        if self.num_beams == 1:
            return
        beams = f"with num_beams={self.num_beams}"

        def given(name: str) -> bool:
            return fields is None or name in fields

        if given("n") and self.n > self.num_beams:
            raise _value_error("n", self.n, f"must be <= num_beams ({self.num_beams}): beam search returns the n best beams")
        if given("temperature") and not self.greedy:
            raise _value_error(
                "temperature", self.temperature,
                f"must be 0 {beams}: beam search keeps the most likely beams (beam sampling is not supported)",
            )
        if given("stop") and self.stop_strings:
            raise _value_error(
                "stop", self.stop, f"stop strings are not supported {beams}; beams end on tokens: use stop_token_ids"
            )
        for name, off in (("top_k", -1), ("top_p", 1.0), ("min_p", 0.0)):
            if given(name) and getattr(self, name) != off:
                raise _value_error(name, getattr(self, name), f"sampling filters do not apply {beams}")
        if given("structured_outputs") and self.structured_outputs is not None:
            raise _value_error(
                "structured_outputs", self.structured_outputs,
                f"structured output is not supported {beams}: use n samples (greedy or random) instead",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def use_beam_search(self) -> bool:
        return self.num_beams > 1

    @property
    def explicit_fields(self) -> frozenset[str]:
        """The fields the caller passed (positionally or by name)."""
        return self._explicit  # type: ignore[attr-defined]

    def replace(self, **changes) -> "SamplingParams":
        """A copy with ``changes`` applied; the changed fields count as explicit too."""
        unknown = set(changes) - set(_FIELD_NAMES)
        if unknown:
            raise TypeError(f"SamplingParams has no field(s) {sorted(unknown)}")
        values = {name: getattr(self, name) for name in _FIELD_NAMES}
        values.update(changes)
        out = SamplingParams.__new__(SamplingParams)
        object.__setattr__(out, "_explicit", self.explicit_fields | frozenset(changes))
        _dataclass_init(out, **values)
        return out


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.init)
_dataclass_init = SamplingParams.__init__


@functools.wraps(_dataclass_init)
def _init_recording_explicit(self, *args, **kwargs) -> None:
    object.__setattr__(self, "_explicit", frozenset(_FIELD_NAMES[: len(args)]) | frozenset(kwargs))
    _dataclass_init(self, *args, **kwargs)


SamplingParams.__init__ = _init_recording_explicit  # type: ignore[method-assign]


@dataclass(frozen=True)
class BeamSearchParams:
    """Beam search settings for :meth:`tandem.LLM.beam_search` (vLLM's name):
    ``beam_width`` beams, the best ``n`` returned (default: all of them)."""

    beam_width: int
    max_tokens: int | None = None
    n: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    ignore_eos: bool = False

    def to_sampling_params(self) -> SamplingParams:
        kwargs = dict(
            num_beams=self.beam_width, n=self.n if self.n is not None else self.beam_width, temperature=0.0,
            length_penalty=self.length_penalty, early_stopping=self.early_stopping, ignore_eos=self.ignore_eos,
        )
        if self.max_tokens is not None:
            kwargs["max_tokens"] = self.max_tokens
        return SamplingParams(**kwargs)


def _type_error(name: str, value: object, want: str, got: str | None = None) -> TypeError:
    return type_error("SamplingParams", name, value, want, got, _MAX_SHOWN)


def _value_error(name: str, value: object, why: str) -> ValueError:
    return value_error("SamplingParams", name, value, why, _MAX_SHOWN)


def _is_int(value: object) -> bool:
    # bool is an int to Python, but max_tokens=True is a mistake, not a 1.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _int(name: str, value: object, low: int | None, want: str | None = None) -> int:
    want = want or f"an integer >= {low}"
    if not _is_int(value):
        raise _type_error(name, value, want)
    as_int = int(value)
    if low is not None and as_int < low:
        raise _value_error(name, value, f"must be {want}")
    return as_int


def _real(name: str, value: object, want: str, ok: Callable[[float], bool]) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise _type_error(name, value, want)
    try:
        as_float = float(value)
    except OverflowError:  # an int too large for a float
        as_float = math.inf
    # NaN fails every comparison, so without this a NaN temperature would
    # pass a range check written the other way round and sample garbage.
    if not math.isfinite(as_float):
        raise _value_error(name, value, f"must be finite ({want})")
    if not ok(as_float):
        raise _value_error(name, value, f"must be {want}")
    return as_float


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise _type_error(name, value, "True or False")
    return value


def _stop_strings(stop: object) -> tuple[str, ...]:
    want = "None, a string or a list of non-empty strings"
    if stop is None:
        return ()
    if isinstance(stop, str):
        items: tuple = (stop,)
    elif isinstance(stop, (list, tuple)):
        items = tuple(stop)
    else:
        raise _type_error("stop", stop, want)
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise _type_error("stop", stop, want, f"but item {i} is {type(s).__name__}")
        if not s:
            # An empty stop string matches at once: every request would end at its first token.
            where = "be empty" if isinstance(stop, str) else f"contain an empty string (item {i})"
            raise _value_error("stop", stop, f"must not {where}")
        check_unicode(s, "SamplingParams.stop" + ("" if isinstance(stop, str) else f"[{i}]"))
    return items


def _token_ids(name: str, ids: object) -> tuple[int, ...]:
    want = "None or a list of integers >= 0"
    if ids is None:
        return ()
    if not isinstance(ids, (list, tuple)):
        raise _type_error(name, ids, want)
    out = []
    for i, t in enumerate(ids):
        if not _is_int(t):
            raise _type_error(name, ids, want, f"but item {i} is {type(t).__name__}")
        if t < 0:
            raise _value_error(name, ids, f"must be integers >= 0 (item {i} is {t})")
        out.append(int(t))
    return tuple(out)


def _token_seqs(name: str, seqs: object) -> tuple[tuple[int, ...], ...]:
    want = "None or a list of non-empty lists of token ids"
    if seqs is None:
        return ()
    if not isinstance(seqs, (list, tuple)):
        raise _type_error(name, seqs, want)
    out = []
    for i, seq in enumerate(seqs):
        if not isinstance(seq, (list, tuple)):
            raise _type_error(name, seqs, want, f"but item {i} is {type(seq).__name__}")
        ids = _token_ids(f"{name}[{i}]", seq)
        if not ids:
            raise _value_error(name, seqs, f"item {i} is empty")
        out.append(ids)
    return tuple(out)


def _logit_bias(bias: object) -> tuple[tuple[int, float], ...]:
    want = "None or a mapping of token id to a real bias"
    if bias is None:
        return ()
    items = bias.items() if isinstance(bias, Mapping) else bias if isinstance(bias, (list, tuple)) else None
    if items is None:
        raise _type_error("logit_bias", bias, want)
    out = {}
    for item in items:
        if not (isinstance(item, (list, tuple)) and len(item) == 2):
            raise _type_error("logit_bias", bias, want, f"but has an entry {item!r}")
        token, value = item
        if isinstance(token, str) and token.strip().lstrip("-").isdigit():  # JSON object keys are strings
            token = int(token)
        if not _is_int(token) or token < 0:
            raise _value_error("logit_bias", bias, f"token id {token!r} must be an integer >= 0")
        lo, hi = LOGIT_BIAS_RANGE
        out[int(token)] = _real("logit_bias", value, f"a bias in [{lo}, {hi}]", lambda x: lo <= x <= hi)
    return tuple(sorted(out.items()))


def _callables(name: str, fns: object) -> tuple[Callable, ...]:
    if fns is None:
        return ()
    if not isinstance(fns, (list, tuple)):
        raise _type_error(name, fns, "None or a list of callables")
    for i, fn in enumerate(fns):
        if not callable(fn):
            raise _type_error(name, fns, "None or a list of callables", f"but item {i} is {type(fn).__name__}")
    return tuple(fns)
