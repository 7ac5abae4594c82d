"""``kv_compress``: cross-attention KV compression settings, checked once at construction.

After a request's first ``window`` decode steps (the observation window), each
(decoder layer, KV head) keeps ``kept_positions`` encoder positions, or its own count
within its layer's budget of ``num_kv_heads x kept_positions`` where the backend reads
per-head budgets (those it attended
to most where its attention was concentrated and static, else evenly spaced ones:
``tandem/core/worker/cross_compress.py``), and the request's cross K/V is re-packed
into fewer blocks (``docs/kv_compress.md``). The settings are plain data: the scheduler reads the
kept count, the worker the window.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

FEATURE = "cross_kv_compress"  # the attention feature a backend declares to serve it
# The attention feature of a backend that also reads a cross table compressed per head
# (``tandem/core/kv/cross_per_head.py``); without it the engine keeps one count per request.
PER_HEAD_FEATURE = "cross_kv_compress_per_head"
_KEYS = ("keep_fraction", "window", "min_keep")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class KVCompressConfig:
    """``keep_fraction``: the share of a request's encoder positions each (layer, KV head)
    keeps, in (0, 1]; the kept count is rounded up to whole blocks (the last block's
    spare slots keep more positions, at no cost). ``window``: decode steps (decoder
    positions past the decoder prompt) whose attention to the encoder is observed before
    compressing, >= 1. ``min_keep``: positions kept at least (an encoder shorter than
    this is never compressed), >= 1."""

    keep_fraction: float = 0.25
    window: int = 1
    min_keep: int = 32

    def __post_init__(self) -> None:
        f = self.keep_fraction
        if not isinstance(f, (int, float)) or isinstance(f, bool) or not math.isfinite(f) or not 0 < f <= 1:
            raise ValueError(f"kv_compress: keep_fraction={f!r}: must be a number in (0, 1]")
        if not _is_int(self.window) or not 1 <= self.window <= 4096:
            raise ValueError(f"kv_compress: window={self.window!r}: must be an integer in [1, 4096]")
        if not _is_int(self.min_keep) or self.min_keep < 1:
            raise ValueError(f"kv_compress: min_keep={self.min_keep!r}: must be an integer >= 1")

    @classmethod
    def parse(cls, value: Any) -> "KVCompressConfig | None":
        """``None`` (off), ``True`` (the defaults), a dict of the fields, its JSON text (the
        command line's form) or a ``KVCompressConfig``. Errors name the key and value."""
        if value is None or value is False or isinstance(value, KVCompressConfig):
            return value or None
        if value is True:
            return cls()
        if isinstance(value, str):
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"kv_compress={value!r}: not a JSON object ({e})") from None
            if not isinstance(parsed, (dict, bool)):
                raise ValueError(f"kv_compress={value!r}: must be a JSON object, true or false")
            return cls.parse(parsed)
        if not isinstance(value, dict):
            raise ValueError(f"kv_compress={value!r}: must be None, True or a dict such as "
                             '{"keep_fraction": 0.25, "window": 1, "min_keep": 32}')
        unknown = [k for k in value if k not in _KEYS]
        if unknown:
            raise ValueError(f"kv_compress: key {unknown[0]!r} is not an option (options: {', '.join(_KEYS)})")
        return cls(**value)

    def kept_positions(self, encoder_len: int, block_size: int) -> int:
        """Positions a request with ``encoder_len`` keeps per (layer, KV head): the
        fraction (at least ``min_keep``), rounded up to whole blocks, at most all."""
        want = max(self.min_keep, math.ceil(self.keep_fraction * encoder_len))
        return min(encoder_len, -(-want // block_size) * block_size)
