"""JSON-schema keywords the grammar does not enforce are refused at the door, naming
the keyword and its JSON pointer; the keywords it does enforce still compile.

Oracles, both independent of tandem's checker: ``jsonschema`` says whether a value
is valid for the schema, and xgrammar's own grammar (compiled without tokenizer)
says whether it would let the value through. Each refused case is a schema whose
grammar accepts a value ``jsonschema`` rejects (so the refusal is needed: an
xgrammar that starts enforcing the keyword fails this test, and the keyword can
leave the list); each taken case is one whose grammar rejects the violating value.
"""

from __future__ import annotations

import json

import pytest

from tandem import StructuredOutputsParams as SO

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
from xgrammar.testing import _is_grammar_accept_string as grammar_accepts  # noqa: E402

# (schema, a value jsonschema rejects that the grammar accepts, keyword named, JSON pointer named)
REFUSED = [
    # the probe's four (issue 37)
    ({"type": "integer", "not": {"type": "integer"}}, "0", "not", "#"),
    ({"not": {}}, '",F{"', "not", "#"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, '"a"', "allOf", "#"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[70, 0, 0]", "uniqueItems", "#"),
    # and the rest found by probing xgrammar
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1", "oneOf", "#"),
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"},
                                             "contains": {"const": 5}}}}, '{"a": [1]}', "contains", "#/properties/a"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "if": {"properties": {"a": {"const": 1}}},
      "then": {"properties": {"a": {"const": 2}}}}, '{"a": 1}', "if", "#"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, '{"a": 1}', "dependentRequired", "#"),
    ({"type": "number", "multipleOf": 0.5}, "0.3", "multipleOf", "#"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 2}, '"aaa"', "maxLength", "#"),
    ({"type": "string", "format": "email", "maxLength": 3}, '"aa@bb.cc"', "maxLength", "#"),
    ({"type": "object", "required": ["a"]}, "{}", "required", "#/required/0"),
    ({"minimum": 3}, "2", "minimum", "#"),
    ({"type": "string", "enum": ["a", 1]}, "1", "enum", "#/enum/1"),
    ({"type": "string", "const": "a", "minLength": 3}, '"a"', "minLength", "#"),
    ({"$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a", "minimum": 5}, "3", "minimum", "#"),
    ({"type": "object", "properties": {"a/b": {"type": "string", "format": "regex"}}},
     '{"a/b": "("}', "format", "#/properties/a~1b"),
]
# (schema, a value jsonschema rejects): the grammar must reject it too
TAKEN = [
    ({"type": "integer", "minimum": 3, "maximum": 9}, "2"),
    ({"type": "integer", "multipleOf": 3}, "4"),
    ({"type": "string", "pattern": "^a$"}, '"b"'),
    ({"type": "string", "minLength": 2, "maxLength": 3}, '"a"'),
    ({"type": "string", "format": "date"}, '"2020-13-45x"'),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}, "[1]"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, "{}"),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "true"),
    ({"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
                {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]}]}, '{"k": "c"}'),
    ({"allOf": [{"type": "integer", "minimum": 3}]}, "2"),
    ({"type": "string", "enum": ["a", "b"], "description": "d"}, '"c"'),
    ({"$defs": {"a": {"type": "integer"}}, "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
      "required": ["x"]}, '{"x": "s"}'),
]


def _grammar(schema):
    return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)


@pytest.mark.parametrize("schema,value,keyword,pointer", REFUSED, ids=[str(c[0])[:60] for c in REFUSED])
def test_a_keyword_the_grammar_does_not_enforce_is_refused_naming_it(schema, value, keyword, pointer):
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    assert not validator.is_valid(json.loads(value)), "the probe's value must break the schema"
    assert grammar_accepts(_grammar(schema), value), "xgrammar now enforces this: the refusal can go"
    with pytest.raises(ValueError) as e:
        SO(json=schema)
    assert f"StructuredOutputsParams.json=" in str(e.value)
    assert f"keyword {keyword!r} at {pointer}:" in str(e.value), str(e.value)
    with pytest.raises(ValueError, match=f"keyword {keyword!r}"):  # the same as JSON text
        SO(json=json.dumps(schema))


@pytest.mark.parametrize("schema,value", TAKEN, ids=[str(c[0])[:60] for c in TAKEN])
def test_a_keyword_the_grammar_enforces_is_taken(schema, value):
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    assert not validator.is_valid(json.loads(value))
    SO(json=schema)  # taken
    assert not grammar_accepts(_grammar(schema), value)


def test_the_shared_specs_and_the_benchmark_schema_are_taken():
    import sys
    from pathlib import Path

    from structured_specs import SCHEMA

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from structured_output import INVOICE_SCHEMA

    SO(json=SCHEMA)
    SO(json=INVOICE_SCHEMA)
