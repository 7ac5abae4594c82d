"""What a request asks its output to follow: a JSON schema, a regex, a choice, a
grammar or any JSON object (vLLM's ``StructuredOutputsParams``). Plain data,
checked at construction; compiling it is the engine's (``manager.py``)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from tandem.core.param_errors import type_error, value_error
from tandem.core.schema_check import UnenforcedSchemaError, check_enforceable

# Bounds on one request's spec, so parsing and hashing it stay cheap at the door;
# compiling is bounded by the engine running it off the step loop.
MAX_SPEC_CHARS = 1 << 20
MAX_CHOICES = 4096
# Nesting of a JSON schema (objects and arrays): far past any real schema, well short of
# Python's recursion limit (json) and of xgrammar's native stack.
MAX_SCHEMA_DEPTH = 128
_MAX_SHOWN = 120
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of:

    * ``json``: a JSON schema, as a dict or its JSON text (stored as text, in the
      order given: property order is the order the output writes them);
    * ``regex``: the output matches it in full (xgrammar's regex dialect, close to
      JavaScript's);
    * ``choice``: the output is one of these strings;
    * ``grammar``: an EBNF grammar (xgrammar's / llama.cpp's GBNF syntax, root
      rule ``root``);
    * ``json_object=True``: any JSON object (OpenAI's ``json_object``).

    ``disable_any_whitespace`` (JSON kinds): whitespace only in the separators
    ``", "`` and ``": "``, one way to write each value; otherwise any amount
    is allowed between JSON tokens, as JSON allows (a model may then write
    whitespace until ``max_tokens``).

    Errors name the field: ``StructuredOutputsParams.<field>=<value>: <why>``.
    A schema keyword the grammar would not enforce (``not``, ``uniqueItems``, ...:
    ``schema_check.py``) is refused here, naming the keyword and its JSON pointer.
    Whether a schema, regex or grammar compiles is known only when the engine
    compiles it: a spec that does not is that request's ``error``.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            got = "none" if not given else " and ".join(given)
            raise ValueError(f"StructuredOutputsParams: set exactly one of {', '.join(KINDS)}; got {got}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise _type_error("disable_any_whitespace", self.disable_any_whitespace, "True or False")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise _type_error("json_object", self.json_object, "True, False or None")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str):
                raise _type_error(name, value, "a string")
            if not value:
                raise _value_error(name, value, "must not be empty")
            if len(value) > MAX_SPEC_CHARS:
                raise _value_error(name, f"<{len(value)} characters>", f"must be at most {MAX_SPEC_CHARS} characters")
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str | tuple[str, ...] | bool:
        """The kind's value, as stored (hashable)."""
        return getattr(self, self.kind)

    @property
    def cache_key(self) -> tuple:
        """Equal keys compile to the same grammar."""
        return (self.kind, self.spec, self.disable_any_whitespace)


def _schema_text(schema: object) -> str:
    # RecursionError: json's C code recurses per nesting level; a 10,000-deep value
    # would otherwise escape as a bare RecursionError naming nothing.
    if isinstance(schema, dict):
        _check_depth(schema, "<a dict>")  # its repr would recurse as deep
        try:
            text = json.dumps(schema, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError) as e:  # a value JSON cannot hold, a cycle
            raise _value_error("json", schema, f"is not JSON-serialisable: {e}") from None
        parsed = schema
    elif isinstance(schema, str):
        text = schema
        if len(text) > MAX_SPEC_CHARS:
            raise _value_error("json", f"<{len(text)} characters>", f"must be at most {MAX_SPEC_CHARS} characters")
        try:
            parsed = json.loads(text)
        except RecursionError:
            raise _value_error("json", schema, f"nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
        except ValueError as e:
            raise _value_error("json", schema, f"is not valid JSON: {e}") from None
        if not isinstance(parsed, (dict, bool)):
            raise _value_error("json", schema, f"a JSON schema is an object or a boolean, not {type(parsed).__name__}")
        _check_depth(parsed, schema)  # its text is shown cut short
    else:
        raise _type_error("json", schema, "a JSON schema: a dict or its JSON text")
    if len(text) > MAX_SPEC_CHARS:
        raise _value_error("json", f"<{len(text)} characters>", f"must be at most {MAX_SPEC_CHARS} characters")
    try:
        check_enforceable(parsed)
    except UnenforcedSchemaError as e:
        raise _value_error("json", schema, f"{e}; the output would not follow the schema") from None
    return text


def _check_depth(value: object, shown: object) -> None:
    """Iterative, so any depth is measured without recursing; a cycle (a dict holding
    itself) is deeper than any bound."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise _value_error("json", shown, f"nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if isinstance(v, dict):
            stack.extend((x, depth + 1) for x in v.values() if isinstance(x, (dict, list)))
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v if isinstance(x, (dict, list)))


def _choices(choice: object) -> tuple[str, ...]:
    if not isinstance(choice, (list, tuple)):
        raise _type_error("choice", choice, "a list of non-empty strings")
    if not choice:
        raise _value_error("choice", choice, "must hold at least one string")
    if len(choice) > MAX_CHOICES:
        raise _value_error("choice", f"<{len(choice)} strings>", f"must hold at most {MAX_CHOICES} strings")
    for i, c in enumerate(choice):
        if not isinstance(c, str):
            raise _type_error("choice", choice, "a list of non-empty strings", f"but item {i} is {type(c).__name__}")
        if not c:
            raise _value_error("choice", choice, f"item {i} is empty")
    if sum(len(c) for c in choice) > MAX_SPEC_CHARS:
        raise _value_error("choice", f"<{len(choice)} strings>", f"must total at most {MAX_SPEC_CHARS} characters")
    return tuple(choice)


def _type_error(name: str, value: object, want: str, got: str | None = None) -> TypeError:
    return type_error("StructuredOutputsParams", name, value, want, got, _MAX_SHOWN)


def _value_error(name: str, value: object, why: str) -> ValueError:
    return value_error("StructuredOutputsParams", name, value, why, _MAX_SHOWN)
