"""Structured output end to end, on a tiny random BART whose byte-level tokenizer can
write any text, and on the shipped demo model.

Oracles: ``json`` + ``jsonschema`` for JSON outputs, ``re.fullmatch`` for regexes,
membership for choices; and, at every step, the set of tokens tandem allowed (the
finite entries of a full-vocabulary ``logprobs``, taken after the mask) against
what an xgrammar ``GrammarMatcher`` built here, from its own vocabulary table, allows
after the same tokens. Random weights give no reason to finish a grammar, so every
request is bounded by ``max_tokens``; an output cut by ``length`` must still be a
prefix the grammar accepts.
"""

from __future__ import annotations

import json
import math
import re
import sys
import threading
import time

import pytest
import torch

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from helpers import assert_preempted, make_bart_bytes, make_byte_tokenizer  # noqa: E402
from tandem import LLM, SamplingParams, StructuredOutputsParams as SO  # noqa: E402
from tandem.core.strategies.structured.backend import XgrammarBackend  # noqa: E402
from structured_specs import CHOICES, REGEX, SCHEMA  # noqa: E402

EOS = 2
HEAD_PADDING = 8  # LM head ids past the tokenizer's vocabulary: never allowed
PROMPTS = ["the rain in spain", "a cat sat", "red blue green small big", "fire water", "king queen bird fish"]
GRAMMAR = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x" item'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_bart_bytes(tmp_path_factory.mktemp("bart_bytes") / "ckpt", seed=0, head_padding=HEAD_PADDING)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def vocab_size(llm):
    return llm.engine.vocab_size


def oracle_compiler(vocab_size: int):
    """xgrammar's compiler over a vocabulary table written here: the byte-level
    tokens as the tokenizer has them, the special tokens other than EOS empty (never
    text: a detokenizer drops them), the LM head's padding ids empty."""
    tok = make_byte_tokenizer()
    encoded = [""] * vocab_size
    for token, idx in tok.get_vocab().items():
        encoded[idx] = "" if idx in (0, 1, 3) else token
    info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size, stop_token_ids=[EOS])
    return xgr.GrammarCompiler(info)


def compile_oracle(compiler, so: SO):
    if so.kind == "json":
        return compiler.compile_json_schema(so.json, any_whitespace=not so.disable_any_whitespace)
    if so.kind == "regex":
        return compiler.compile_regex(so.regex)
    if so.kind == "choice":
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in so.choice))
    if so.kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=not so.disable_any_whitespace,
                                            strict_mode=False)
    return compiler.compile_grammar(so.grammar)


def allowed_by(matcher, vocab_size: int) -> set[int]:
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    bits = (bitmask[0].unsqueeze(1) >> torch.arange(32)) & 1  # [words, 32], bit j of word w = token 32w + j
    return set(bits.flatten()[:vocab_size].nonzero().flatten().tolist())


def check_steps_against_oracle(completion, compiled, vocab_size: int) -> None:
    """Every step's allowed set equals the oracle's after the same tokens, every token
    is accepted, and the completion ends as the grammar says: terminated on EOS when
    it stopped, a valid prefix when cut by length."""
    matcher = xgr.GrammarMatcher(compiled)
    assert len(completion.logprobs) == len(completion.token_ids)
    for step, (token, top) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert len(top) == vocab_size
        allowed = {t for t, lp in top.items() if lp > -math.inf}
        assert allowed == allowed_by(matcher, vocab_size), f"step {step}"
        assert not allowed & set(range(vocab_size - HEAD_PADDING, vocab_size))
        assert matcher.accept_token(token), f"step {step}: token {token}"
    if completion.finish_reason == "stop":
        assert completion.token_ids[-1] == EOS and matcher.is_terminated()
    else:
        assert completion.finish_reason == "length" and not matcher.is_terminated()


def check_text(so: SO, text: str) -> None:
    if so.kind == "json":
        jsonschema.validate(json.loads(text), json.loads(so.json))
    elif so.kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif so.kind == "regex":
        assert re.fullmatch(so.regex, text), text
    elif so.kind == "choice":
        assert text in so.choice
    else:
        assert re.fullmatch(r"\((x*[0-9])(,x*[0-9])*\)", text), text


KINDS = {
    "json": SO(json=SCHEMA, disable_any_whitespace=True),
    "regex": SO(regex=REGEX),
    "choice": SO(choice=CHOICES),
    "grammar": SO(grammar=GRAMMAR),
    "json_object": SO(json_object=True, disable_any_whitespace=True),
}


@pytest.mark.parametrize("kind", ["json", "regex", "choice"])
def test_greedy_outputs_are_valid_and_finish_by_the_grammar(llm, kind):
    so = KINDS[kind]
    params = SamplingParams(temperature=0, max_tokens=110, structured_outputs=so)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for o in outs:
        (c,) = o.outputs
        assert o.error is None and c.finish_reason == "stop", (c.text, c.finish_reason)
        check_text(so, c.text)
    if kind == "choice":  # the random model does not pick one choice for every prompt
        assert len({o.outputs[0].text for o in outs}) > 1


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_step_allows_exactly_what_xgrammar_allows(llm, vocab_size, kind):
    """Sampled (n=3, seeded) beside plain requests, so rows of several structured
    sequences and of plain ones interleave in each step."""
    so = KINDS[kind]
    compiled = compile_oracle(oracle_compiler(vocab_size), so)
    structured = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=24, logprobs=vocab_size,
                                structured_outputs=so)
    plain = SamplingParams(temperature=1.0, seed=1, max_tokens=24, logprobs=vocab_size)
    outs = llm.generate(PROMPTS[:4], [structured, plain, structured, plain], use_tqdm=False)
    narrowed = 0
    for o, p in zip(outs, [structured, plain, structured, plain]):
        assert o.error is None
        for c in o.outputs:
            if p is plain:  # nothing masked
                assert all(len([lp for lp in top.values() if lp > -math.inf]) == vocab_size for top in c.logprobs)
                continue
            check_steps_against_oracle(c, compiled, vocab_size)
            narrowed += len(c.token_ids)
            if c.finish_reason == "stop":
                check_text(so, c.text)
    assert narrowed > 0
    assert len(outs[0].outputs) == 3


def test_a_mixed_batch_loses_nothing_and_leaves_plain_outputs_unchanged(llm):
    plain = SamplingParams(temperature=0, max_tokens=12)
    bad = {
        "json": SO(json={"type": "objectx"}),
        "regex": SO(regex="(ab"),
        "grammar": SO(grammar='root ::= "a" |'),
    }
    good = KINDS["json"]
    params = [plain, SamplingParams(temperature=0, max_tokens=110, structured_outputs=good), plain]
    params += [SamplingParams(temperature=0, max_tokens=20, structured_outputs=so) for so in bad.values()]
    prompts = (PROMPTS * 2)[: len(params)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outs) == len(params)
    alone = llm.generate([prompts[0], prompts[2]], plain, use_tqdm=False)
    for o, ref in zip([outs[0], outs[2]], alone):
        assert o.error is None and o.outputs[0].token_ids == ref.outputs[0].token_ids
    assert outs[1].error is None
    check_text(good, outs[1].outputs[0].text)
    for o, kind in zip(outs[3:], bad):
        assert o.finished and o.error.startswith(f"StructuredOutputsParams.{kind}: cannot be compiled: ")
    assert "objectx" in outs[3].error and "parenthesis" in outs[4].error
    bm = llm.engine.block_manager
    assert bm.num_free_blocks() == bm.num_total_blocks()
    assert llm.engine.health().status == "ok"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_structured_outputs_identical(model_dir, llm, mode):
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=KINDS[k])
              for k in ("json", "regex", "grammar", "json_object", "choice")]
    # The same requests twice over, so the pool runs short and the scheduler preempts
    # (32 blocks: with jump-forward the requests finish in fewer steps, and 48 no longer ran short).
    params, prompts = params * 2, PROMPTS * 2
    small = LLM(model=str(model_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=32,
                preemption_mode=mode)
    outs = small.generate(prompts, params, use_tqdm=False)
    assert_preempted(small, mode)
    ref = llm.generate(prompts, params, use_tqdm=False)
    for o, r, p in zip(outs, ref, params):
        assert o.error is None and o.outputs[0].token_ids == r.outputs[0].token_ids
        if o.outputs[0].finish_reason == "stop":
            check_text(p.structured_outputs, o.outputs[0].text)


def test_a_slow_compile_blocks_no_other_request(llm, monkeypatch):
    """The compile of one spec is held until the others are done: they run to the
    end while it waits unscheduled; then it runs and is valid."""
    slow = SO(regex=r"[0-9]{3}z")  # not compiled before in this module
    release = threading.Event()
    compile_spec = XgrammarBackend.compile

    def held(self, so):
        if so == slow:
            assert release.wait(60)
        return compile_spec(self, so)

    monkeypatch.setattr(XgrammarBackend, "compile", held)
    engine = llm.engine
    engine.add_request("slow", PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, structured_outputs=slow))
    engine.add_request("plain", PROMPTS[1], SamplingParams(temperature=0, max_tokens=10))
    engine.add_request("fast", PROMPTS[2], SamplingParams(temperature=0, max_tokens=30,
                                                          structured_outputs=KINDS["choice"]))
    finished = {}
    deadline = time.monotonic() + 60
    while not {"plain", "fast"} <= finished.keys():
        assert time.monotonic() < deadline
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert "slow" not in finished and engine.has_unfinished_requests()
    assert [g.request_id for g in engine.scheduler.waiting] == ["slow"]
    assert finished["fast"].outputs[0].text in CHOICES
    release.set()
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["slow"].error is None
    check_text(slow, finished["slow"].outputs[0].text)


def test_identical_specs_compile_once(llm, monkeypatch):
    calls = []
    compile_spec = XgrammarBackend.compile

    def counted(self, so):
        calls.append(so)
        return compile_spec(self, so)

    monkeypatch.setattr(XgrammarBackend, "compile", counted)
    so = SO(regex="q[rs]{1,3}")
    llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=8, structured_outputs=so), use_tqdm=False)
    llm.generate(PROMPTS[3:], SamplingParams(temperature=0, max_tokens=8, structured_outputs=SO(regex="q[rs]{1,3}")),
                 use_tqdm=False)
    assert calls == [so]


def test_a_frontend_can_check_a_spec_before_queueing_it(llm):
    """The server's hook: a bad spec fails its future with the field and the cause, a
    good one compiles (and the request that follows reuses the compile)."""
    from tandem.core.strategies.structured.backend import GrammarCompileError

    bad = llm.engine.compile_structured_outputs(SO(json={"type": "object", "properties": {"a": {"type": 5}}}))
    with pytest.raises(GrammarCompileError, match=r"^StructuredOutputsParams.json: cannot be compiled: ") as e:
        bad.result(timeout=60)
    assert isinstance(e.value, ValueError)
    good = KINDS["grammar"]
    assert llm.engine.compile_structured_outputs(good).result(timeout=60) is not None
    assert llm.engine.compile_structured_outputs(SO(grammar=GRAMMAR)) is llm.engine.compile_structured_outputs(good)


def test_ignore_eos_still_ends_where_the_grammar_ends(llm):
    so = KINDS["choice"]
    outs = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                    structured_outputs=so), use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop" and c.token_ids[-1] == EOS and c.text in CHOICES


def test_without_xgrammar_plain_requests_run_and_structured_ones_name_the_extra(model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    bare = LLM(model=str(model_dir), dtype="float32", device="cpu")
    out = bare.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5
    structured = SamplingParams(max_tokens=5, structured_outputs=SO(regex="a"))
    with pytest.raises(ImportError, match=r"xgrammar.*install the 'structured' extra: .*tandem-engine\[structured\]"):
        bare.engine.add_request("s", PROMPTS[0], structured)
    plain = SamplingParams(temperature=0, max_tokens=5)
    rejected, out = bare.generate(PROMPTS[:2], [structured, plain], use_tqdm=False)
    assert "tandem-engine[structured]" in rejected.error and [c.finish_reason for c in rejected.outputs] == ["error"]
    assert bare.engine.health().status == "ok" and len(out.outputs[0].token_ids) == 5


def test_the_demo_model_keeps_to_choices_and_regexes():
    """The demo's word-level vocabulary has no JSON punctuation, so only word
    grammars apply; its outputs are still members and full matches."""
    from importlib.resources import files

    demo = LLM(model=str(files("tandem") / "demo_model"), dtype="float32", device="cpu")
    prompts = ["the cat sat on the mat", "my dog ran to the park", "a red bird sang", "the sun is hot"]
    choice = SO(choice=["cat", "dog", "bird", "sun"])
    regex = SO(regex="(red|blue|green|hot|cold)")
    for so in (choice, regex):
        outs = demo.generate(prompts, SamplingParams(temperature=0, max_tokens=6, structured_outputs=so),
                             use_tqdm=False)
        for o in outs:
            assert o.error is None and o.outputs[0].finish_reason == "stop"
            check_text(so, o.outputs[0].text)


def test_the_demo_model_writes_several_words_that_follow_the_spec():
    """The demo's decoder joins words with a space: ``(cat|dog)+`` must not end as
    'dog dog dog', and a choice of several words must be writable."""
    from importlib.resources import files

    demo = LLM(model=str(files("tandem") / "demo_model"), dtype="float32", device="cpu")
    prompts = ["the cat sat on the mat", "my dog ran to the park", "a red bird sang", "the sun is hot"]
    specs = [SO(regex="(cat|dog)+"), SO(regex="(cat|dog)( (cat|dog))*"),
             SO(choice=["big cat", "a small dog ran", "sun"])]
    several = []
    for so in specs:
        outs = demo.generate(prompts, SamplingParams(temperature=0, max_tokens=8, structured_outputs=so),
                             use_tqdm=False)
        for o in outs:
            c = o.outputs[0]
            if o.error is None:
                assert c.finish_reason == "stop"
                check_text(so, c.text)
                several += [c.text] if " " in c.text else []
            else:  # xgrammar does not look ahead: 'do' may begin 'dog', and then no token continues it
                assert c.finish_reason == "no_allowed_token" and "cannot be satisfied" in o.error
    assert several, "no output of several words finished: the spaced specs were never checked"
