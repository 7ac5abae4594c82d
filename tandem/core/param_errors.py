"""How request-parameter classes name a bad value: ``Owner.field=<value>: why``, the value
shortened so a huge one (a long list, a big schema) never floods a log or a response."""

from __future__ import annotations


def shown(value: object, limit: int) -> str:
    """``repr(value)``, cut to ``limit`` characters with ``...`` at the end when longer."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def type_error(owner: str, name: str, value: object, want: str, got: str | None, limit: int) -> TypeError:
    got = got or f"not {type(value).__name__}"
    return TypeError(f"{owner}.{name}={shown(value, limit)}: must be {want}, {got}")


def value_error(owner: str, name: str, value: object, why: str, limit: int) -> ValueError:
    return ValueError(f"{owner}.{name}={shown(value, limit)}: {why}")
