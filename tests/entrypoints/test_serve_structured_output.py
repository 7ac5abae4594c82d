"""Structured output through ``POST /v1/completions``: OpenAI's ``response_format``
and vLLM's fields (``structured_outputs``, ``guided_*``), plain and streamed, driven
by the official openai client (and plain HTTP for the error bodies), in-process
through ``httpx.ASGITransport`` on a tiny random BART whose byte-level tokenizer
can write any text.

Oracles: ``jsonschema`` for JSON, ``re.fullmatch`` for regexes and grammars,
membership for choices; for the fields whose outputs a random model cannot finish
(JSON with any whitespace), the engine served directly with the
``StructuredOutputsParams`` the field stands for; for plain requests in flight
beside structured ones, the same requests served alone.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys

import httpx
import pytest

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

from helpers import make_bart_bytes  # noqa: E402
from tandem import AsyncLLM, SamplingParams, StructuredOutputsParams as SO  # noqa: E402
from tandem.entrypoints.openai.api_server import build_app  # noqa: E402
from structured_specs import CHOICES, REGEX, SCHEMA  # noqa: E402

WAIT = 60.0
PROMPTS = ["the rain in spain", "a cat sat", "red blue green small big", "fire water"]
GRAMMAR = 'root ::= "(" item ("," item)? ")"\nitem ::= [0-9] | "x" [0-9]'  # bounded: the model must finish


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_bart_bytes(tmp_path_factory.mktemp("serve_so") / "ckpt", seed=0)


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = AsyncLLM(model=str(model_dir), dtype="float32", device="cpu")
    yield engine
    asyncio.run(engine.shutdown(timeout=WAIT))


def _http(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=WAIT)


def _openai(app):
    return openai.AsyncOpenAI(base_url="http://t/v1", api_key="none", http_client=_http(app), max_retries=0)


async def _served_directly(engine, prompt: str, so: SO, max_tokens: int) -> str:
    last = None
    async for out in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                              structured_outputs=so)):
        last = out
    assert last.error is None
    return last.outputs[0].text


@pytest.mark.asyncio
async def test_json_regex_choice_and_grammar_outputs_are_valid(engine):
    client = _openai(build_app(engine, served_model_name="m"))
    cases = [
        ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
         lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
        ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
        ({"guided_choice": CHOICES}, lambda t: t in CHOICES or pytest.fail(t)),
        ({"guided_grammar": GRAMMAR}, lambda t: re.fullmatch(r"\(x?[0-9](,x?[0-9])?\)", t) or pytest.fail(t)),
    ]
    for extra, check in cases:
        res = await client.completions.create(model="m", prompt=PROMPTS, max_tokens=110, temperature=0,
                                              extra_body=extra)
        assert len(res.choices) == len(PROMPTS)
        for c in res.choices:
            assert c.finish_reason == "stop", (extra, c.text)
            check(c.text)
        if "guided_choice" in extra:  # the random model does not pick one choice for every prompt
            assert len({c.text for c in res.choices}) > 1


@pytest.mark.asyncio
async def test_each_field_means_its_structured_outputs_params(engine):
    """Each way of asking is served as the engine serves the StructuredOutputsParams it
    stands for (JSON with any whitespace: the random model writes whitespace until
    max_tokens, so the oracle is the engine itself, not jsonschema)."""
    client = _openai(build_app(engine, served_model_name="m"))
    cases = [
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "pets", "schema": SCHEMA, "strict": True}}}, SO(json=SCHEMA)),
        ({"response_format": {"type": "json_object"}}, SO(json_object=True)),
        ({"guided_json": json.dumps(SCHEMA)}, SO(json=SCHEMA)),
        ({"structured_outputs": {"choice": CHOICES}}, SO(choice=CHOICES)),
        ({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
         SO(json_object=True, disable_any_whitespace=True)),
    ]
    for extra, so in cases:
        res = await client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                              extra_body=extra)
        assert res.choices[0].text == await _served_directly(engine, PROMPTS[0], so, 24), extra
    text = (await client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                            extra_body={"response_format": {"type": "text"}})).choices[0].text
    plain = (await client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=24, temperature=0)).choices[0]
    assert text == plain.text


@pytest.mark.asyncio
async def test_streamed_structured_output_equals_the_plain_answer(engine):
    client = _openai(build_app(engine, served_model_name="m"))
    kwargs = dict(model="m", prompt=PROMPTS[1], max_tokens=110, temperature=0, n=2, seed=3,
                  extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    whole = await client.completions.create(**kwargs)
    texts, finish = {0: "", 1: ""}, {}
    async for chunk in await client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]
    assert finish == {0: "stop", 1: "stop"}
    for t in texts.values():
        jsonschema.validate(json.loads(t), SCHEMA)


BAD = [
    ({"guided_json": {"type": "objectx"}}, "guided_json", "objectx"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": 5}}}}}}, "response_format.json_schema.schema", "cannot be compiled"),
    ({"guided_regex": "(ab"}, "guided_regex", "parenthesis"),
    ({"guided_grammar": 'root ::= "a" |'}, "guided_grammar", "cannot be compiled"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_choice": []}, "guided_choice", "at least one"),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs", "json and regex"),
    ({"structured_outputs": {"jsn": SCHEMA}}, "structured_outputs.jsn", "Extra inputs"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema", "required"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex and guided_choice", "one per request"),
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "response_format and guided_json",
     "one per request"),
    ({"response_format": {"type": "json_object"}, "guided_grammar": "root ::= \"a\"",
      "structured_outputs": {"regex": "a"}}, "response_format, guided_grammar and structured_outputs", "one"),
    ({"guided_regex": "a", "num_beams": 2}, "structured_outputs", "beam"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True])
async def test_a_bad_spec_is_a_400_naming_the_field_and_queues_nothing(engine, monkeypatch, stream):
    queued = []
    generate = engine.generate
    monkeypatch.setattr(engine, "generate", lambda *a, **k: queued.append(a) or generate(*a, **k))
    async with _http(build_app(engine, served_model_name="m")) as c:
        for extra, field, why in BAD:
            r = await c.post("/v1/completions", json={"prompt": "the rain", "max_tokens": 5, "stream": stream, **extra})
            assert r.status_code == 400, (extra, r.text)
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and error["code"] == 400
            assert field in error["message"] and why in error["message"], (extra, error)
    assert queued == [] and engine.health().status == "ok"


@pytest.mark.asyncio
async def test_the_openai_client_sees_the_field_of_a_bad_schema(engine):
    client = _openai(build_app(engine, served_model_name="m"))
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model="m", prompt="x", max_tokens=5,
                                        extra_body={"guided_json": {"type": "object", "required": 3}})
    assert e.value.status_code == 400 and e.value.body["param"] == "guided_json"
    assert e.value.body["message"].startswith("guided_json: StructuredOutputsParams.json: cannot be compiled: ")


@pytest.mark.asyncio
async def test_structured_requests_in_flight_leave_plain_outputs_unchanged(engine):
    client = _openai(build_app(engine, served_model_name="m"))

    async def plain(prompt):
        res = await client.completions.create(model="m", prompt=prompt, max_tokens=16, temperature=0)
        return res.choices[0].text

    alone = [await plain(p) for p in PROMPTS]
    structured = [
        {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
        {"guided_regex": REGEX},
        {"guided_choice": CHOICES},
        {"guided_json": {"type": "objectx"}},  # refused with a 400 while the others run
    ]

    async def constrained(extra, prompt):
        try:
            res = await client.completions.create(model="m", prompt=prompt, max_tokens=110, temperature=0, n=2,
                                                  seed=1, extra_body=extra)
            return [c.text for c in res.choices]
        except openai.BadRequestError as e:
            return e

    results = await asyncio.gather(*[plain(p) for p in PROMPTS],
                                   *[constrained(x, p) for x, p in zip(structured, PROMPTS)])
    assert results[: len(PROMPTS)] == alone
    json_out, regex_out, choice_out, bad = results[len(PROMPTS):]
    for t in json_out:
        jsonschema.validate(json.loads(t), SCHEMA)
    assert all(re.fullmatch(REGEX, t) for t in regex_out) and all(t in CHOICES for t in choice_out)
    assert isinstance(bad, openai.BadRequestError) and "objectx" in bad.body["message"]
    assert engine.health().status == "ok"


@pytest.mark.asyncio
async def test_without_xgrammar_structured_requests_are_501s_naming_the_extra(model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    bare = AsyncLLM(model=str(model_dir), dtype="float32", device="cpu")
    try:
        async with _http(build_app(bare, served_model_name="m")) as c:
            r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "guided_regex": "a"})
            assert r.status_code == 501
            assert "guided_regex" in r.json()["error"]["message"]
            assert "tandem-engine[structured]" in r.json()["error"]["message"]
            r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        await bare.shutdown(timeout=WAIT)
