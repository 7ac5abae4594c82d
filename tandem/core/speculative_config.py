"""``speculative_config``: vLLM's dictionary shape, checked once at construction."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# "draft_model" is vLLM's name for a draft checkpoint; {"model": DIR, ...} without a
# method means it too.
METHODS = ("ngram", "draft_model")
# When not given: suffixes of 3 tokens down to 1 are looked up.
DEFAULT_LOOKUP_MAX, DEFAULT_LOOKUP_MIN = 3, 1
_KEYS = {
    "ngram": ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"),
    "draft_model": ("method", "model", "num_speculative_tokens"),
}


def _is_int(x) -> bool:  # config.is_int's rule; importing it would be a cycle (config imports this)
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SpeculativeConfig:
    """``num_speculative_tokens`` (k): tokens proposed per sequence per step. ``ngram``:
    the prompt-lookup proposer matches the longest suffix of ``prompt_lookup_max`` down
    to ``prompt_lookup_min`` decoder tokens. ``draft_model``: ``model`` (a checkpoint
    directory or Hub repo id) proposes k tokens greedily (``speculative/draft.py``)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 0
    prompt_lookup_min: int = 0
    model: str | None = None

    @classmethod
    def parse(cls, value: Any) -> "SpeculativeConfig | None":
        """``None``, a dict, or its JSON text (the command line's form) -> a checked config.
        Errors name the key and the bad value."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config={value!r}: not a JSON object ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config={value!r}: must be None or a dict such as "
                             '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4} or '
                             '{"model": "path/to/draft", "num_speculative_tokens": 4}')
        method = value.get("method", "draft_model" if "model" in value else None)
        if method is None:
            raise ValueError(f"speculative_config={value!r}: needs 'method' (one of {', '.join(METHODS)}) "
                             "or 'model' (a draft checkpoint)")
        if method not in METHODS:
            raise ValueError(f"speculative_config: method={method!r} is not known (known: {', '.join(METHODS)})")
        unknown = [k for k in value if k not in _KEYS[method]]
        if unknown:
            raise ValueError(f"speculative_config: key {unknown[0]!r} is not an option of method {method!r} "
                             f"(options: {', '.join(_KEYS[method])})")

        def positive(key: str, default: int | None) -> int:
            v = value.get(key, default)
            if v is None:
                raise ValueError(f"speculative_config: {key} is required")
            if not _is_int(v) or not 1 <= v <= 64:
                raise ValueError(f"speculative_config: {key}={v!r}: must be an integer in [1, 64]")
            return v

        k = positive("num_speculative_tokens", None)
        if method == "draft_model":
            model = value.get("model")
            if isinstance(model, Path):
                model = str(model)
            if not isinstance(model, str) or not model.strip():
                raise ValueError(f"speculative_config: model={model!r}: method 'draft_model' needs the draft "
                                 "checkpoint: a local directory or a Hugging Face Hub repo id")
            return cls(method, k, model=model)
        hi = positive("prompt_lookup_max", DEFAULT_LOOKUP_MAX)
        lo = positive("prompt_lookup_min", min(DEFAULT_LOOKUP_MIN, hi))
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        return cls(method, k, hi, lo)
