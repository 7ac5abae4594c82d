"""Per-request sampling settings, checked and frozen at construction."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
import enum
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
# torch.Generator.manual_seed reads the seed as a signed or an unsigned 64-bit
# integer and raises a bare "Overflow when unpacking long long" outside this.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
# A stop_token_ids list of thousands of ids should not become a page-long error.
_MAX_SHOWN = 200


class RequestOutputKind(enum.IntEnum):
    """What ``LLMEngine.step()`` returns for a request that advanced."""

    CUMULATIVE = 0  # everything generated so far, every step
    DELTA = 1  # only the tokens and text new since the last output
    FINAL_ONLY = 2  # nothing until the request finishes


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request.

    ``temperature == 0`` is greedy decoding. ``max_tokens`` counts generated
    tokens (the decoder prompt is not counted); ``min_tokens`` suppresses EOS
    and ``stop_token_ids`` until that many tokens exist. ``logprobs=k`` returns
    the top-k log-probabilities (plus the chosen token's) for every step.
    ``top_k`` of 0 or -1 means off (stored as -1). ``output_kind`` says what
    ``LLMEngine.step()`` returns for the request as it advances (``LLM.generate``
    always returns the final output).

    Every field is checked here, type before range: a wrong type raises
    ``TypeError`` and a wrong value ``ValueError``, both worded
    ``SamplingParams.<field>=<value>: <why>``. Limits that depend on the model
    (``logprobs`` and ``stop_token_ids`` against the vocabulary, ``max_tokens``
    against the decoder positions) are checked by the engine per request.

    The object is frozen, so one instance can be shared by many requests.
    NumPy integers and floats are converted to ``int`` / ``float``; ``stop``
    given as a list and ``stop_token_ids`` are stored as tuples, copies the
    caller cannot mutate, which also keeps instances hashable.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Derived from ``stop``; left out of eq/hash because ``stop`` already decides it.
    stop_strings: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        put("n", _int("n", self.n, 1))
        put("temperature", _real("temperature", self.temperature, "a real number >= 0", lambda x: x >= 0))
        top_k = _int("top_k", self.top_k, -1, "-1 or 0 (off), or an integer >= 1")
        put("top_k", -1 if top_k == 0 else top_k)
        put("top_p", _real("top_p", self.top_p, "a real number in (0, 1]", lambda x: 0 < x <= 1))
        put("min_p", _real("min_p", self.min_p, "a real number in [0, 1]", lambda x: 0 <= x <= 1))
        if self.seed is not None:
            seed = _int("seed", self.seed, None, "None or an integer")
            if not _SEED_MIN <= seed <= _SEED_MAX:
                raise _value_error("seed", self.seed, "must be in [-2**63, 2**64 - 1], the range torch seeds take")
            put("seed", seed)
        put("max_tokens", _int("max_tokens", self.max_tokens, 1))
        put("min_tokens", _int("min_tokens", self.min_tokens, 0))
        if self.min_tokens > self.max_tokens:
            raise _value_error("min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            put("logprobs", _int("logprobs", self.logprobs, 0, "None or an integer >= 0"))
        put("ignore_eos", _bool("ignore_eos", self.ignore_eos))
        put("skip_special_tokens", _bool("skip_special_tokens", self.skip_special_tokens))
        if not isinstance(self.output_kind, RequestOutputKind):
            kinds = ", ".join(f"RequestOutputKind.{k.name}" for k in RequestOutputKind)
            raise TypeError(f"SamplingParams.output_kind={self.output_kind!r}: must be one of {kinds}")

        stop_strings = _stop_strings(self.stop)
        if not isinstance(self.stop, str) and self.stop is not None:
            put("stop", stop_strings)
        put("stop_strings", stop_strings)
        put("stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


def _type_error(name: str, value: object, want: str, got: str | None = None) -> TypeError:
    got = got or f"not {type(value).__name__}"
    return TypeError(f"SamplingParams.{name}={_show(value)}: must be {want}, {got}")


def _value_error(name: str, value: object, why: str) -> ValueError:
    return ValueError(f"SamplingParams.{name}={_show(value)}: {why}")


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
