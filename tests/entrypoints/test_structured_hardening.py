"""A hostile client's structured outputs (issue "Hardening v4"; whitespace from
"First run v4"): every grammar's cost bounded before compiling, jump-forward's
search under a CPU-time budget that fails only its request, external ``$ref``
refused, a JSON output the grammar ended checked against its schema, whitespace
runs bounded by default.

On a tiny random BART with the byte-level tokenizer (any text, a token per byte
plus a few merges). Each case failed on the code before: the counts and the
never-ending rule ran the jump-forward search until the process was killed (or
24 s a call), the control character finished as ``stop``, the ``$ref`` was
ignored, and whitespace ran until ``max_tokens``.
"""

from __future__ import annotations

import json
import re
import time

import pytest

xgr = pytest.importorskip("xgrammar")
pytest.importorskip("jsonschema")

from helpers import make_bart_bytes, make_byte_tokenizer  # noqa: E402
from tandem import LLM, SamplingParams, StructuredOutputsParams as SO  # noqa: E402

PROMPT = "the rain in spain"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_bart_bytes(tmp_path_factory.mktemp("bart_bytes") / "ckpt", seed=0)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), dtype="float32", device="cpu")


def token_of(text: str) -> int:
    (tid,) = make_byte_tokenizer().encode(text, add_special_tokens=False)
    return tid


def one(llm, so: SO, **params):
    params.setdefault("max_tokens", 24)
    (out,) = llm.generate([PROMPT], SamplingParams(temperature=0, structured_outputs=so, **params), use_tqdm=False)
    return out


@pytest.mark.parametrize("so, says", [
    # Grew memory ~150 MB/s in the jump-forward search until the OOM killer.
    (SO(regex="x{2147483647}"), "a repetition count of 2147483647 (in rule 'root'), over the limit of 10000 (engine "
                                "option structured_outputs_max_repeat)"),
    # 24-31 s a search, on the engine thread.
    (SO(regex="(a?){5000}a{5000}"), "an element that can match nothing repeated up to 5000 times"),
    # Forces text forever: killed for memory within seconds.
    (SO(grammar='root ::= "x" root'), "rule 'root' can never end"),
    (SO(grammar='root ::= "a" | "b" loop\nloop ::= "x" loop'), "rule 'loop' can never end"),
    (SO(grammar='root ::= ("x"{100}){1000}'), "matches no text shorter than 100000 characters"),
    (SO(json={"type": "array", "items": {"const": 1}, "minItems": 100000}), "a repetition count of 99999"),
    (SO(json={"$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}},
              "$ref": "#/$defs/a"}), "rule 'defs_a' can never end"),
])
def test_a_grammar_over_a_cost_bound_fails_its_request_before_compiling(llm, so, says):
    t0 = time.monotonic()
    out = one(llm, so)
    assert out.error is not None and says in out.error, out.error
    assert out.error.startswith(f"StructuredOutputsParams.{so.kind}: refused before compiling: ")
    assert out.outputs[0].token_ids == []
    assert time.monotonic() - t0 < 20


def test_the_repeat_limit_is_an_engine_option(model_dir):
    small = LLM(model=str(model_dir), dtype="float32", device="cpu", structured_outputs_max_repeat=3)
    out = one(small, SO(regex="[0-9]{4}"))
    assert "a repetition count of 4 (in rule 'root'), over the limit of 3" in out.error
    out = one(small, SO(regex="[0-9]{3}"))
    assert out.error is None and re.fullmatch("[0-9]{3}", out.outputs[0].text)
    with pytest.raises(ValueError, match="structured_outputs_max_repeat=0"):
        LLM(model=str(model_dir), dtype="float32", device="cpu", structured_outputs_max_repeat=0)


def test_counts_within_the_limits_are_served(llm):
    out = one(llm, SO(regex="x{40}"), max_tokens=64)
    assert out.error is None and out.outputs[0].text == "x" * 40 and out.outputs[0].finish_reason == "stop"


def test_a_slow_jump_forward_search_fails_only_its_request(model_dir):
    """``(a{0,30}a{30}){30}`` is within every bound, but its nested counts (900) make
    finding its forced text take a tenth of a second of CPU a call (17 s for
    ``((a{0,10}a{10}){10}){10}``): the search runs under the CPU budget, and past it
    the request fails, naming it, while a plain request beside it is served."""
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", structured_outputs_jump_timeout=0.02)
    slow = SamplingParams(temperature=0, max_tokens=16, structured_outputs=SO(regex="(a{0,30}a{30}){30}"))
    plain = SamplingParams(temperature=0, max_tokens=16)
    t0 = time.monotonic()
    bad, good = llm.generate([PROMPT, PROMPT], [slow, plain], use_tqdm=False)
    assert bad.error is not None and "structured_outputs_jump_timeout" in bad.error, bad.error
    assert bad.error.startswith("StructuredOutputsParams.regex: finding the text its grammar forces next took more "
                                "than 0.02 s of CPU time")
    assert good.error is None and len(good.outputs[0].token_ids) == 16
    assert time.monotonic() - t0 < 20
    # The engine serves on, jump-forward included.
    out = one(llm, SO(regex="ab{12}c"))
    assert out.error is None and out.outputs[0].text == "a" + "b" * 12 + "c"
    assert llm.get_stats()["structured_jump_forward_tokens"] > 0


def test_a_grammar_whose_search_memory_is_not_bounded_decodes_without_jumping(llm):
    """``(a{0,256}a{256}){16}`` passes the count bounds, but one search for its forced
    text ran out of 4 GB: its nested counts (4096) turn jump-forward off for it; its
    tokens are decoded one at a time, within the same bounds as any."""
    before = llm.get_stats()["structured_jump_forward_tokens"]
    out = one(llm, SO(regex="(a{0,256}a{256}){16}"), max_tokens=12)
    assert out.error is None and out.outputs[0].text == "a" * 12 and out.outputs[0].finish_reason == "length"
    assert llm.get_stats()["structured_jump_forward_tokens"] == before


@pytest.mark.parametrize("ref", ["file:///etc/passwd", "http://127.0.0.1/schema.json", "other.json#/a", 5])
def test_an_external_ref_is_refused(ref):
    with pytest.raises(ValueError, match=r"keyword '\$ref' at #/properties/a: .* is not a reference inside this "
                                         r"schema: only '#' and '#/\.\.\.' references are resolved"):
        SO(json={"type": "object", "properties": {"a": {"$ref": ref}}})
    SO(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/s"}}, "$defs": {"s": {"type": "string"}}})


def test_an_invalid_json_output_fails_instead_of_finishing_as_stop(llm):
    """xgrammar's length-bounded strings admit raw control characters: pushed onto one
    (``logit_bias``), the output is ``"\\x1a\\x1a\\x1a"``, which JSON forbids."""
    so = SO(json={"type": "string", "minLength": 3, "maxLength": 3})
    out = one(llm, so, logit_bias={token_of("\x1a"): 100.0})
    assert out.error is not None, out.outputs[0]
    assert out.outputs[0].finish_reason != "stop"
    assert out.error.startswith("StructuredOutputsParams.json: the output its grammar ended is not valid for the "
                                "schema: it is not valid JSON (Invalid control character at: line 1 column ")
    assert out.error.endswith("it is refused rather than finished as 'stop'")
    # Without the push the same schema finishes, valid.
    out = one(llm, so, logit_bias={token_of("Q"): 100.0})
    assert out.error is None and out.outputs[0].finish_reason == "stop" and len(json.loads(out.outputs[0].text)) == 3


def test_whitespace_runs_are_bounded_by_default(model_dir, llm):
    """Pushed onto ``\\r`` (a weak model's loop), a JSON object writes at most 8
    whitespace characters in a row by default; ``structured_outputs_max_whitespace=0``
    allows any run, as before."""
    so = SO(json_object=True)
    bias = {token_of("\r"): 50.0}
    out = one(llm, so, max_tokens=40, logit_bias=bias)
    text = out.outputs[0].text
    assert out.error is None and text.startswith("{")
    assert max(len(r) for r in re.findall(r"\s+", text)) == 8, repr(text)
    free = LLM(model=str(model_dir), dtype="float32", device="cpu", structured_outputs_max_whitespace=0)
    out = one(free, so, max_tokens=40, logit_bias=bias)
    assert max(len(r) for r in re.findall(r"\s+", out.outputs[0].text)) > 30
    with pytest.raises(ValueError, match="structured_outputs_max_whitespace=-1"):
        LLM(model=str(model_dir), dtype="float32", device="cpu", structured_outputs_max_whitespace=-1)
