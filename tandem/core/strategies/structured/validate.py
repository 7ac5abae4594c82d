"""After generation: a JSON output the grammar ended is checked against its schema.

The grammar is meant to admit only valid outputs, but xgrammar's grammars are not
always exact (its length-bounded strings, ``{"type": "string", "minLength": 3,
"maxLength": 3}``, admit raw control characters, which JSON forbids in a string:
``'",F\x1a"'`` finished as ``stop``). So when a JSON request's grammar ends its
output, the text is parsed (``json.loads``, which refuses control characters in
strings) and validated with ``jsonschema``; one that fails fails its request
instead of finishing as ``stop``.

Two parts of the schema are left to the grammar: ``pattern`` and
``patternProperties`` (with the ``additionalProperties`` /
``unevaluatedProperties`` that depend on them). Python's ``re`` backtracks, holds
the GIL and cannot be stopped; a schema's pattern run on the engine thread could
stall every request (``(a*)*b``), while the grammar matched it in linear time.
"""

from __future__ import annotations

import json
from collections import OrderedDict

# Validators kept, by schema text (least recently used dropped first).
_CACHE_SIZE = 64


class OutputChecker:
    """One per engine: ``why_invalid(so, text)``."""

    def __init__(self) -> None:
        self._validators: OrderedDict[str, object] = OrderedDict()

    def why_invalid(self, schema_text: str | None, text: bytes) -> str | None:
        """Why ``text`` is not a valid JSON value for ``schema_text`` (None: any JSON
        object, ``json_object``), or None where it is (or cannot be checked: nesting
        deeper than Python's parser goes is left to the grammar)."""
        try:
            value = json.loads(text.decode("utf-8"))
        except UnicodeDecodeError as e:
            return f"it is not valid UTF-8 ({e.reason} at byte {e.start})"
        except RecursionError:
            return None
        except ValueError as e:
            return f"it is not valid JSON ({e})"
        if schema_text is None:
            return None if isinstance(value, dict) else f"it is a JSON {type(value).__name__}, not an object"
        validator = self._validator(schema_text)
        if validator is None:
            return None
        try:
            errors = sorted(validator.iter_errors(value), key=lambda e: (len(e.path), str(e.message)))
        except RecursionError:
            return None
        if not errors:
            return None
        e = errors[0]
        where = "#" + "".join(f"/{p}" for p in e.absolute_path)
        return f"at {where}: {_cut(e.message)}"

    def _validator(self, schema_text: str):
        v = self._validators.get(schema_text)
        if v is None:
            try:
                import jsonschema
            except ImportError:
                return None  # the parse check above still ran
            schema = json.loads(schema_text)
            base = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
            cls = jsonschema.validators.extend(base, {
                "pattern": _skip, "patternProperties": _skip, "unevaluatedProperties": _skip,
                "additionalProperties": _additional(base.VALIDATORS.get("additionalProperties")),
            })
            v = cls(schema)
            self._validators[schema_text] = v
            while len(self._validators) > _CACHE_SIZE:
                self._validators.popitem(last=False)
        self._validators.move_to_end(schema_text)
        return v


def _skip(validator, value, instance, schema):
    return iter(())


def _additional(default):
    def additional(validator, value, instance, schema):
        if default is None or "patternProperties" in schema:
            return iter(())  # which properties are additional needs the patterns: the grammar's
        return default(validator, value, instance, schema)
    return additional


def _cut(text: str, n: int = 200) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."
