"""Jump-forward decoding of structured output (``core/strategies/structured/jump.py``).

The exact oracle: on a tiny random BART whose tokenizer has one token per byte and
no merges, a forced string has exactly one tokenization, so at each forced position
the grammar allows exactly one token and masked greedy decoding must pick it: the
jump appends the very tokens plain decoding would have sampled. So outputs with
jump-forward equal those without, token for token, and a lone request needs one
forward pass per *sampled* token: ``len(token_ids) - jumped`` passes instead of
``len(token_ids)``. With the usual byte-level BPE (merges such as ``{"``) the
model may spell forced text with other tokens than the tokenizer would: there the
oracle is the schema (``jsonschema``) and the grammar (a fresh matcher accepts the
output), and the boundary retokenization is checked token by token.
"""

from __future__ import annotations

import json
import re

import pytest

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from helpers import make_bart, make_bart_bytes, make_byte_tokenizer  # noqa: E402
from tandem import LLM, SamplingParams, StructuredOutputsParams as SO  # noqa: E402
from structured_specs import CHOICES, REGEX, SCHEMA  # noqa: E402

PROMPTS = ["the rain in spain", "a cat sat", "red blue green small big"]
GRAMMAR = 'root ::= "(" item ("," item)? ")"\nitem ::= [0-9] | "xyz" [0-9]'
SPECS = {
    "json": SO(json=SCHEMA, disable_any_whitespace=True),
    "regex": SO(regex=REGEX),
    "choice": SO(choice=CHOICES),
    "grammar": SO(grammar=GRAMMAR),
}
JUMPED = "structured_jump_forward_tokens"


def pure_byte_tokenizer():
    """Byte-level BPE with BART's special ids (<s>=0 <pad>=1 </s>=2 <unk>=3) and no
    merges: every text has exactly one tokenization, a token per byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<s>", "<pad>", "</s>", "<unk>"])}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


@pytest.fixture(scope="module")
def byte_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("jump_bytes") / "ckpt"
    tok = pure_byte_tokenizer()
    make_bart(path, seed=0, with_tokenizer=False, vocab_size=len(tok.get_vocab()) + 4)
    tok.save_pretrained(path)
    return path


def counted(llm: LLM) -> list[int]:
    """Counts the engine's forward passes (executor steps that ran the model)."""
    ex = llm.engine.executor
    run, n = ex.execute_model, [0]

    def execute_model(*args, **kwargs):
        result = run(*args, **kwargs)
        n[0] += result is not None
        return result

    ex.execute_model = execute_model
    return n


@pytest.fixture(scope="module")
def jump(byte_dir):
    llm = LLM(model=str(byte_dir), dtype="float32", device="cpu")
    return llm, counted(llm)


@pytest.fixture(scope="module")
def plain(byte_dir):
    llm = LLM(model=str(byte_dir), dtype="float32", device="cpu", structured_outputs_disable_jump_forward=True)
    return llm, counted(llm)


def check_text(so: SO, text: str) -> None:
    if so.kind == "json":
        jsonschema.validate(json.loads(text), json.loads(so.json))
    elif so.kind == "regex":
        assert re.fullmatch(so.regex, text), text
    elif so.kind == "choice":
        assert text in so.choice, text
    else:
        assert re.fullmatch(r"\((xyz)?[0-9](,(xyz)?[0-9])?\)", text), text


def served(llm_counter, prompt, params):
    """One request alone: its output and the forward passes and jumped tokens it took."""
    llm, passes = llm_counter
    before_passes, before_jumped = passes[0], llm.get_stats()[JUMPED]
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert out.error is None, out.error
    return out, passes[0] - before_passes, llm.get_stats()[JUMPED] - before_jumped


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_jumped_outputs_equal_plain_decoding_with_fewer_forward_passes(jump, plain, kind):
    so = SPECS[kind]
    params = SamplingParams(temperature=0, max_tokens=100, structured_outputs=so)
    saved = 0
    for prompt in PROMPTS:
        got, passes, jumped = served(jump, prompt, params)
        want, want_passes, none = served(plain, prompt, params)
        g, w = got.outputs[0], want.outputs[0]
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
        assert g.finish_reason == "stop"  # the specs are bounded: the grammar ends every output
        check_text(so, g.text)
        # Off: one forward pass per token. On: one per token not jumped.
        assert none == 0 and want_passes == len(w.token_ids)
        assert passes == len(g.token_ids) - jumped
        saved += jumped
    assert saved > 0


def test_max_tokens_cuts_a_jump_and_is_never_exceeded(jump, plain):
    so = SPECS["json"]
    full, _, _ = served(jump, PROMPTS[0], SamplingParams(temperature=0, max_tokens=100, structured_outputs=so))
    tokens = full.outputs[0].token_ids
    assert len(tokens) > 12
    for m in (1, 2, 3, 5, 8, 12):
        params = SamplingParams(temperature=0, max_tokens=m, structured_outputs=so)
        got, _, _ = served(jump, PROMPTS[0], params)
        want, _, _ = served(plain, PROMPTS[0], params)
        c = got.outputs[0]
        assert list(c.token_ids) == list(tokens[:m]) == list(want.outputs[0].token_ids)
        assert c.finish_reason == "length"


def test_stop_token_ids_and_stop_strings_inside_a_forced_string(jump, plain):
    """'-' is forced after the digits of REGEX's "(ab|c)[0-9]{2,4}-(yes|no)" only once
    four digits are written; "yes"/"no" are forced after their first letter."""
    tok = pure_byte_tokenizer()
    dash = tok.convert_tokens_to_ids("-")
    for extra in ({"stop_token_ids": [dash]}, {"stop": ["-y", "-n", "es"]}, {"stop_token_ids": [dash], "min_tokens": 3}):
        params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=SPECS["regex"], **extra)
        for prompt in PROMPTS:
            got, _, _ = served(jump, prompt, params)
            want, _, _ = served(plain, prompt, params)
            g, w = got.outputs[0], want.outputs[0]
            assert (g.text, g.finish_reason, g.stop_reason) == (w.text, w.finish_reason, w.stop_reason), extra
            assert g.finish_reason == "stop"
            if "stop" in extra:
                # Found in the text of a step's tokens: the text is cut, the step's tokens
                # stay (as with speculation); a jump's span holds more of them.
                assert list(g.token_ids[: len(w.token_ids)]) == list(w.token_ids)
            else:
                assert g.token_ids == w.token_ids


def test_structured_and_plain_requests_in_one_batch(jump, plain):
    """Plain rows beside jumping ones (several tokens a step) give what they give
    alone; the structured rows what they give without jumps; n > 1 jumps per sequence."""
    llm, _ = jump
    plain_params = SamplingParams(temperature=0, max_tokens=20)
    so_params = SamplingParams(temperature=0, max_tokens=100, structured_outputs=SPECS["json"])
    sampled = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=100, structured_outputs=SPECS["json"])
    before = llm.get_stats()[JUMPED]
    outs = llm.generate(PROMPTS + PROMPTS + PROMPTS[:1], [plain_params] * 3 + [so_params] * 3 + [sampled],
                        use_tqdm=False)
    assert all(o.error is None for o in outs)
    alone = [served(plain, p, plain_params)[0] for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in outs[:3]] == [a.outputs[0].token_ids for a in alone]
    without = [served(plain, p, so_params)[0] for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in outs[3:6]] == [w.outputs[0].token_ids for w in without]
    assert len(outs[6].outputs) == 3
    for c in outs[6].outputs:
        check_text(SPECS["json"], c.text)
    # Every completion of the json spec jumps over its first key at least.
    assert llm.get_stats()[JUMPED] - before >= 6 * len('"ok": ')


def test_requests_asking_for_logprobs_do_not_jump(jump):
    params = SamplingParams(temperature=0, max_tokens=100, logprobs=1, structured_outputs=SPECS["json"])
    out, passes, jumped = served(jump, PROMPTS[0], params)
    c = out.outputs[0]
    assert jumped == 0 and passes == len(c.token_ids) == len(c.logprobs)


def test_jump_counters_in_metrics(jump):
    from prometheus_client import generate_latest

    from tandem.entrypoints.openai.metrics import ServerMetrics

    llm, _ = jump
    served(jump, PROMPTS[1], SamplingParams(temperature=0, max_tokens=100, structured_outputs=SPECS["json"]))
    stats = llm.get_stats()
    text = generate_latest(ServerMetrics(llm.llm_engine).registry).decode()
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in text.splitlines() if line and not line.startswith("#")}
    assert samples["tandem:structured_jump_forward_tokens_total"] == stats[JUMPED] > 0
    assert samples["tandem:structured_jump_forward_steps_total"] == stats["structured_jump_forward_steps"] > 0


def test_the_off_switch_is_an_engine_option_checked_by_name(byte_dir):
    from tandem.core.engine_args import add_cli_args
    import argparse

    args = add_cli_args(argparse.ArgumentParser()).parse_args(["--structured-outputs-disable-jump-forward"])
    assert args.structured_outputs_disable_jump_forward is True
    with pytest.raises(ValueError, match="structured_outputs_disable_jump_forward='yes'"):
        LLM(model=str(byte_dir), dtype="float32", device="cpu", structured_outputs_disable_jump_forward="yes")


# -- the token boundary, with merges (helpers.BYTE_MERGES: '{"', '":', '",' ...) -------------------------


@pytest.fixture(scope="module")
def merges_backend():
    from tandem.core.strategies.structured.backend import XgrammarBackend

    tok = make_byte_tokenizer()
    backend = XgrammarBackend(tok, len(tok.get_vocab()), [2])
    return tok, backend


def _jumper(backend):
    from tandem.core.strategies.structured.jump import JumpCounters, JumpForward

    strings, never = backend.token_bytes()
    counters = JumpCounters()
    return JumpForward(backend.tokenizer, strings, never, counters), counters


def _mask(matcher, vocab):
    m = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(m)
    return m.tolist()


def test_the_sampled_token_is_retokenized_with_the_forced_text(merges_backend):
    """After '{' the schema forces '"ok": '; BPE writes '{"' as one token, so the
    sampled '{' is replaced by '{"' and the rest follows; the matcher is where a fresh
    one is after the same text. After '{"ok": t' it forces 'rue, "n": ': 't' + 'rue'
    is the one token 'true' (merges 'tr', 'ue', 'true'), which replaces 't'."""
    tok, backend = merges_backend
    compiled = backend.compile(SPECS["json"])
    jumper, counters = _jumper(backend)
    matcher = backend.matcher(compiled)
    brace = tok.convert_tokens_to_ids("{")
    assert matcher.accept_token(brace)
    ids = jumper.after(matcher, brace, room=100)
    assert ids[0] == tok.convert_tokens_to_ids('{"') and ids == tok.encode('{"ok": ', add_special_tokens=False)
    assert tok.decode(ids) == '{"ok": '
    assert counters.retokenized == 1 and counters.tokens == len(ids) - 1
    fresh = backend.matcher(compiled)
    assert fresh.accept_string('{"ok": ')
    assert _mask(matcher, backend.vocab_size) == _mask(fresh, backend.vocab_size)
    t = tok.convert_tokens_to_ids("t")
    assert matcher.accept_token(t)
    ids = jumper.after(matcher, t, room=100)
    assert ids[0] == tok.convert_tokens_to_ids("true") and tok.decode(ids) == 'true, "n": '
    assert counters.retokenized == 2
    # room bounds the jump; none left: no jump, the matcher untouched.
    m2 = backend.matcher(compiled)
    assert m2.accept_token(brace)
    assert jumper.after(m2, brace, room=0) is None
    ids = jumper.after(m2, brace, room=2)
    assert len(ids) == 3 and tok.decode(ids) == '{"ok'


@pytest.mark.slow
def test_outputs_with_merges_validate_and_take_fewer_passes(tmp_path):
    d = make_bart_bytes(tmp_path / "ckpt", seed=0)
    llm = LLM(model=str(d), dtype="float32", device="cpu")
    n = counted(llm)
    params = SamplingParams(temperature=0, max_tokens=110, structured_outputs=SPECS["json"])
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop"
        check_text(SPECS["json"], c.text)
    assert n[0] < sum(len(o.outputs[0].token_ids) for o in outs)
    assert llm.get_stats()[JUMPED] > 0
