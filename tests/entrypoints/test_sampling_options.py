"""A ``SamplingParams`` field marked for the server or the CLI reaches it by itself: driven by
``dataclasses.fields(SamplingParams)``, every field marked ``api`` is a request field of
``/v1/completions`` (same default, its value reaching ``SamplingParams`` as given), every field
marked ``cli`` a flag of ``tandem generate``, and every field a row of docs/generation.md's
"Request fields" table (issue 38)."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path

import pytest

from tandem.core.sampling_params import SamplingParams
from tandem.entrypoints.cli import _build_parser
from tandem.entrypoints.openai.protocol import CompletionRequest
from tandem.entrypoints.sampling_options import markdown_table, sampling_kwargs

ROOT = Path(__file__).resolve().parents[2]
FIELDS = [f for f in dataclasses.fields(SamplingParams) if f.init]
API = [f for f in FIELDS if f.metadata.get("api") is not None]
CLI = [f for f in FIELDS if f.metadata.get("cli")]


def sample(api: object, default: object):
    """A valid JSON value of type ``api`` other than ``default``, built from the type alone."""
    if isinstance(api, types.UnionType):
        api = typing.get_args(api)[0]
    if api is bool:
        return not default
    if api is int:
        return 1 if default != 1 else 2
    if api is float:
        return 0.5
    if api is str:
        return "x"
    origin, args = typing.get_origin(api), typing.get_args(api)
    if origin is list:
        return [sample(args[0], None)]
    if origin is dict:
        return {"1": sample(args[1], None)}
    raise AssertionError(f"no sample for {api}")


def api_name(f) -> str:
    return f.metadata["api_name"] or f.name


def test_the_server_and_the_cli_take_the_fields_they_took_before():
    # What the hand-written request model and flags held (a floor: fields may be added).
    before_api = {"max_tokens", "temperature", "top_p", "n", "seed", "logprobs", "presence_penalty",
                  "frequency_penalty", "logit_bias", "top_k", "min_p", "min_tokens", "ignore_eos",
                  "repetition_penalty", "stop_token_ids", "skip_special_tokens", "no_repeat_ngram_size",
                  "num_beams", "length_penalty", "bad_words_ids", "allowed_token_ids", "stop"}
    assert before_api <= {api_name(f) for f in API}
    flags = _build_parser()[1]["generate"]._option_string_actions
    assert {"--max-tokens", "--temperature", "--top-p", "--top-k", "--num-beams", "--request-seed"} <= set(flags)


@pytest.mark.parametrize("f", API, ids=lambda f: f.name)
def test_every_api_field_is_a_request_field_with_the_same_default(f):
    model_field = CompletionRequest.model_fields[api_name(f)]
    assert model_field.default is None  # left out: the generation config's, else SamplingParams'
    assert model_field.description == f.metadata["help"]
    left_out = CompletionRequest.model_validate({"prompt": "x"}).sampling_params()
    assert getattr(left_out, f.name) == getattr(SamplingParams(), f.name)
    assert f.name not in left_out.explicit_fields

    value = sample(f.metadata["api"], f.default)
    req = CompletionRequest.model_validate_json(json.dumps({"prompt": "x", api_name(f): value}))
    got = req.sampling_params()
    assert f.name in got.explicit_fields
    assert getattr(got, f.name) == getattr(SamplingParams(**{f.name: value}), f.name)
    assert getattr(got, f.name) != getattr(SamplingParams(), f.name)


@pytest.mark.parametrize("f", CLI, ids=lambda f: f.name)
def test_every_cli_field_is_a_generate_flag(f):
    flag = f.metadata["cli"] if isinstance(f.metadata["cli"], str) else "--" + f.name.replace("_", "-")
    value = sample(f.metadata["api"], f.default)
    if isinstance(value, bool):
        argv = [flag if value else "--no-" + flag[2:]]
    else:
        argv = [flag, value if isinstance(value, str) else json.dumps(value)]
    parser = _build_parser()[1]["generate"]
    assert sampling_kwargs(parser.parse_args(["--model", "m", "p"])) == {}
    given = sampling_kwargs(parser.parse_args(["--model", "m", *argv, "p"]))
    assert getattr(SamplingParams(**given), f.name) == getattr(SamplingParams(**{f.name: value}), f.name)
    assert set(given) == {f.name}


def test_a_stop_flag_takes_plain_text_or_json():
    parser = _build_parser()[1]["generate"]
    assert sampling_kwargs(parser.parse_args(["--model", "m", "--stop", ".", "p"])) == {"stop": "."}
    assert sampling_kwargs(parser.parse_args(["--model", "m", "--stop", '["a", "b"]', "p"])) == {"stop": ["a", "b"]}


def test_the_docs_table_is_generated_from_the_fields():
    table = markdown_table()
    assert table in (ROOT / "docs" / "generation.md").read_text(), (
        "docs/generation.md's 'Request fields' table is not what "
        "`python -m tandem.entrypoints.sampling_options` prints: paste its output there"
    )
    for f in FIELDS:
        assert f"| `{f.name}` |" in table
    serving = (ROOT / "docs" / "serving.md").read_text()
    for f in API:
        assert f"`{api_name(f)}`" in serving
