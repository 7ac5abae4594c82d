"""Structured output the model's vocabulary cannot write (issue 39): the request
fails with an ``error`` naming why and where (offline: ``LLM.generate``; a real
``tandem serve`` on 127.0.0.1: a 400 in OpenAI's shape, or a stream's last error
event), never a success with empty text or the non-OpenAI ``no_allowed_token``
reason; the requests beside it are served as if alone.

The shipped demo model's vocabulary is whole lowercase words. The oracle for
"cannot be written" is that vocabulary itself: no token holds ``{`` (so no JSON
object can begin) or ``!`` (so ``cat!`` can write ``cat`` and then nothing).
"""

from __future__ import annotations

import concurrent.futures
import json
from importlib.resources import files

import httpx
import pytest

pytest.importorskip("xgrammar")

from tandem import LLM, SamplingParams, StructuredOutputsParams as SO  # noqa: E402

DEMO = str(files("tandem") / "demo_model")
PROMPT = "the cat sat on the mat"
SCHEMA = {"type": "object", "properties": {"animal": {"type": "string"}}, "required": ["animal"]}
CHOICES = ["cat", "dog", "bird"]
WAIT = 60.0  # per HTTP call; each takes well under a second on the demo model


@pytest.fixture(scope="module")
def llm():
    return LLM(model=DEMO, dtype="float32", device="cpu")


def test_the_oracle_the_demo_vocabulary_lacks_the_characters(llm):
    vocab = llm.engine.tokenizer.get_vocab()
    assert not any("{" in t or "!" in t for t in vocab) and "cat" in vocab


def test_unsatisfiable_requests_fail_alone_naming_where_the_grammar_ran_out(llm):
    cat = llm.engine.tokenizer.convert_tokens_to_ids("cat")
    params = [
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=SO(json=SCHEMA)),
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=SO(json_object=True)),
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=SO(regex="cat!")),
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=SO(choice=CHOICES)),
        SamplingParams(temperature=0, max_tokens=8),
        SamplingParams(temperature=0, max_tokens=8, n=2, structured_outputs=SO(json=SCHEMA)),
    ]
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    start = "cannot be satisfied by this model's vocabulary: at the start of the output, its grammar allows no token"
    for i, kind in [(0, "json"), (1, "json_object")]:
        assert outs[i].error.startswith(f"StructuredOutputsParams.{kind}: {start}"), outs[i].error
        c = outs[i].outputs[0]
        assert (c.text, c.token_ids, c.finish_reason) == ("", [], "no_allowed_token")
    mid = outs[2]
    assert mid.error.startswith("StructuredOutputsParams.regex: cannot be satisfied by this model's vocabulary: "
                                "after 1 generated token, its grammar allows no token"), mid.error
    c = mid.outputs[0]
    assert (c.text, c.token_ids, c.finish_reason) == ("cat", [cat], "no_allowed_token")  # what it had is kept
    assert "(completion 0)" in outs[5].error and [c.finish_reason for c in outs[5].outputs] == ["no_allowed_token"] * 2
    # The batch's good requests: as served alone.
    for i in (3, 4):
        alone = llm.generate([PROMPT], params[i], use_tqdm=False)[0]
        assert outs[i].error is None and outs[i].outputs[0].finish_reason == "stop"
        assert outs[i].outputs[0].token_ids == alone.outputs[0].token_ids
    assert outs[3].outputs[0].text in CHOICES
    s = llm.get_stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"] and llm.engine.health().status == "ok"


def test_bans_that_remove_every_token_the_grammar_allows_are_named(llm):
    vocab = llm.engine.vocab_size
    eos_banned = SamplingParams(temperature=0, max_tokens=8, min_tokens=3, structured_outputs=SO(choice=["cat"]))
    all_banned = SamplingParams(temperature=0, max_tokens=8, suppress_tokens=list(range(vocab)),
                                structured_outputs=SO(choice=["cat"]))
    after_cat, at_start = llm.generate([PROMPT] * 2, [eos_banned, all_banned], use_tqdm=False)
    # After "cat" the grammar allows EOS alone, which min_tokens bans.
    assert after_cat.error.startswith(
        "StructuredOutputsParams.choice: cannot be satisfied under this request's sampling parameters: after 1 "
        "generated token, its grammar allows 1 token and the request bans it"), after_cat.error
    assert after_cat.outputs[0].text == "cat" and after_cat.outputs[0].finish_reason == "no_allowed_token"
    assert "at the start of the output, its grammar allows 1 token and the request bans it" in at_start.error


# -- through a real server --------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from test_serve import _start, _stop

    proc, url = _start(DEMO, "--served-model-name", "demo",
                       log_path=tmp_path_factory.mktemp("serve_unsat") / "serve.log")
    yield url
    assert _stop(proc) == 0


def _post(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **body},
                      timeout=WAIT)


def _error(r: httpx.Response) -> str:
    assert r.status_code == 400, r.text[:500]
    assert r.headers["content-type"].startswith("application/json"), r.text[:300]
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("invalid_request_error", 400), err
    return err["message"]


FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_schema_nothing_can_begin_is_a_400_before_any_output(server, stream):
    for extra, kind in [({"response_format": FORMAT}, "json"), ({"guided_json": SCHEMA}, "json"),
                        ({"response_format": {"type": "json_object"}}, "json_object"),
                        ({"structured_outputs": {"json": SCHEMA}}, "json")]:
        msg = _error(_post(server, stream=stream, **extra))
        assert msg.startswith(f"StructuredOutputsParams.{kind}: cannot be satisfied by this model's vocabulary: "
                              "at the start of the output"), msg


def test_a_grammar_that_runs_out_midway_is_a_400_with_the_text_so_far(server):
    msg = _error(_post(server, guided_regex="cat!"))
    assert "after 1 generated token, its grammar allows no token" in msg, msg
    assert msg.endswith("; the text generated so far: 'cat'"), msg


def test_a_stream_that_runs_out_midway_ends_with_a_400_error_event(server):
    r = _post(server, guided_regex="cat!", stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text[:300]
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert "data: [DONE]" not in r.text  # an error is the stream's last event, as for any failure
    *chunks, last = events
    assert "".join(c["choices"][0]["text"] for c in chunks) == "cat"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    assert (last["error"]["code"], last["error"]["type"]) == (400, "invalid_request_error"), last
    assert "StructuredOutputsParams.regex: cannot be satisfied" in last["error"]["message"]


def test_the_openai_client_sees_a_bad_request(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", timeout=WAIT, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo", prompt=PROMPT, max_tokens=8, extra_body={"response_format": FORMAT})
    assert "cannot be satisfied by this model's vocabulary" in e.value.body["message"]
    with pytest.raises(openai.APIError, match="cannot be satisfied"):
        for _ in client.completions.create(model="demo", prompt=PROMPT, max_tokens=8, stream=True,
                                           extra_body={"guided_regex": "cat!"}):
            pass


def test_requests_beside_unsatisfiable_ones_are_served_as_alone(server):
    good = [{}, {"guided_choice": CHOICES}, {"prompt": "a red bird sang", "guided_regex": "(red|blue|green|hot|cold)"}]
    bad = [{"response_format": FORMAT}, {"guided_regex": "cat!"}, {"guided_regex": "cat!", "stream": True}]

    def texts(r: httpx.Response):
        assert r.status_code == 200, r.text[:300]
        return [(c["text"], c["finish_reason"]) for c in r.json()["choices"]]

    alone = [texts(_post(server, **g)) for g in good]
    with concurrent.futures.ThreadPoolExecutor(len(good) + len(bad)) as pool:
        futures = [pool.submit(_post, server, **body) for body in good + bad]
        responses = [f.result() for f in futures]
    assert [texts(r) for r in responses[: len(good)]] == alone
    assert [r.status_code for r in responses[len(good):]] == [400, 400, 200]  # the stream fails in its events
    assert "error" in responses[-1].text
    assert httpx.get(f"{server}/health", timeout=WAIT).text == "ok"
    metrics = httpx.get(f"{server}/metrics", timeout=WAIT).text
    assert "no_allowed_token" not in metrics  # failed requests are no finish reason


def test_no_200_ever_carries_the_non_openai_reason(server):
    """Every token banned (no grammar): a 400 naming the bans, not 200 no_allowed_token.
    Single-token bad words for all but EOS (HF keeps EOS out of those), and EOS by min_tokens."""
    vocab = 375  # the demo model's (tandem/demo_model/config.json)
    msg = _error(_post(server, min_tokens=3, bad_words_ids=[[t] for t in range(vocab)]))
    assert msg.startswith("at the start of the output, every token is banned for this request"), msg
