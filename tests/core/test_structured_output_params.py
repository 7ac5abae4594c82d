"""StructuredOutputsParams is checked at construction, each error naming its field;
SamplingParams takes it, refuses it with beam search, and an explicit one turns
off beam search that came only from the checkpoint's defaults."""

import json

import pytest

from tandem import SamplingParams, StructuredOutputsParams
from tandem.core.generation_config import merge_params

SCHEMA = {"type": "object", "properties": {"b": {"type": "boolean"}, "a": {"type": "integer"}}}


@pytest.mark.parametrize("kwargs, kind", [
    (dict(json=SCHEMA), "json"),
    (dict(json=json.dumps(SCHEMA)), "json"),
    (dict(regex="[a-z]+"), "regex"),
    (dict(choice=["yes", "no"]), "choice"),
    (dict(grammar='root ::= "a"'), "grammar"),
    (dict(json_object=True), "json_object"),
])
def test_each_kind_alone_is_accepted(kwargs, kind):
    so = StructuredOutputsParams(**kwargs)
    assert so.kind == kind
    hash(so)  # frozen and hashable, so SamplingParams stays hashable
    hash(SamplingParams(structured_outputs=so))


def test_a_schema_is_kept_as_text_in_its_own_property_order():
    so = StructuredOutputsParams(json=SCHEMA)
    assert isinstance(so.json, str) and list(json.loads(so.json)["properties"]) == ["b", "a"]
    assert so.cache_key == StructuredOutputsParams(json=json.dumps(SCHEMA)).cache_key


@pytest.mark.parametrize("kwargs, words", [
    (dict(), "got none"),
    (dict(json_object=False), "got none"),
    (dict(json=SCHEMA, regex="a"), "got json and regex"),
    (dict(choice=["a"], grammar='root ::= "a"', json_object=True), "got choice and grammar and json_object"),
])
def test_exactly_one_kind(kwargs, words):
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object") as e:
        StructuredOutputsParams(**kwargs)
    assert words in str(e.value)


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(json="{not json"), ValueError, "StructuredOutputsParams.json='{not json': is not valid JSON"),
    (dict(json="[1, 2]"), ValueError, "a JSON schema is an object or a boolean, not list"),
    (dict(json=3), TypeError, "StructuredOutputsParams.json=3: must be a JSON schema"),
    (dict(json={"x": {1, 2}}), ValueError, "not JSON-serialisable"),
    (dict(regex=""), ValueError, "StructuredOutputsParams.regex='': must not be empty"),
    (dict(regex=b"a+"), TypeError, "StructuredOutputsParams.regex=b'a+': must be a string"),
    (dict(grammar=""), ValueError, "StructuredOutputsParams.grammar='': must not be empty"),
    (dict(choice=[]), ValueError, "StructuredOutputsParams.choice=[]: must hold at least one string"),
    (dict(choice="yes"), TypeError, "StructuredOutputsParams.choice='yes': must be a list"),
    (dict(choice=["a", 2]), TypeError, "but item 1 is int"),
    (dict(choice=["a", ""]), ValueError, "item 1 is empty"),
    (dict(json_object="yes"), TypeError, "StructuredOutputsParams.json_object='yes'"),
    (dict(json_object=True, disable_any_whitespace=1), TypeError, "disable_any_whitespace=1: must be True or False"),
])
def test_bad_values_name_the_field(kwargs, exc, words):
    with pytest.raises(exc) as e:
        StructuredOutputsParams(**kwargs)
    assert words in str(e.value)


def test_a_spec_too_large_is_refused_without_echoing_it():
    from tandem.core.structured_params import MAX_SPEC_CHARS

    with pytest.raises(ValueError) as e:
        StructuredOutputsParams(regex="a" * (MAX_SPEC_CHARS + 1))
    assert f"<{MAX_SPEC_CHARS + 1} characters>" in str(e.value) and len(str(e.value)) < 300


def test_sampling_params_wants_the_params_object():
    with pytest.raises(TypeError, match=r"SamplingParams.structured_outputs=\{'json'.*StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": SCHEMA})


def test_beam_search_with_structured_outputs_is_refused_naming_both():
    so = StructuredOutputsParams(choice=["a", "b"])
    with pytest.raises(ValueError, match=r"SamplingParams.structured_outputs=.*not supported with num_beams=2"):
        SamplingParams(num_beams=2, structured_outputs=so)


def test_explicit_structured_outputs_turn_off_beam_search_from_the_defaults():
    defaults = SamplingParams(num_beams=4, temperature=0.0, max_tokens=30)
    so = StructuredOutputsParams(regex="[ab]+")
    merged = merge_params(defaults, SamplingParams(structured_outputs=so))
    assert merged.num_beams == 1 and merged.structured_outputs == so and merged.max_tokens == 30
    # Explicit beams and a grammar together stay an error.
    with pytest.raises(ValueError, match="structured_outputs"):
        merge_params(defaults, SamplingParams(num_beams=2, structured_outputs=so))
