"""Values that would overflow the computation are refused at the door, naming the
field; list-valued fields are capped; a request whose every token is banned ends
with its own finish reason; no -Infinity or NaN ever reaches JSON."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from tandem import LLM, AsyncLLM, SamplingParams
from tandem.core import sampling_params as sp
from tandem.core.worker.warpers import sampling_probs
from tandem.entrypoints.openai.api_server import build_app

PROMPT = {"prompt_token_ids": [0, 5, 9, 17, 2]}


@pytest.mark.parametrize("field, value, says", [
    ("length_penalty", 400.0, "[-10.0, 10.0]"),  # the beam score's len ** 400 overflowed a Python float
    ("length_penalty", -11.0, "[-10.0, 10.0]"),
    ("top_p", 1e-300, "smallest normal"),  # 0 in float32: every token dropped, token 0 drawn
    ("top_p", 1e-39, "smallest normal"),
    ("logit_bias", {3: 1e300}, "[-100.0, 100.0]"),  # inf in float32, then NaN
    ("logit_bias", {3: -101}, "[-100.0, 100.0]"),
    ("repetition_penalty", 1e-300, "[0.01, 100.0]"),  # 0 in float32: x / 0
    ("repetition_penalty", 1e300, "[0.01, 100.0]"),
    ("temperature", 1e300, "float32"),  # inf in float32: -inf / inf is NaN
])
def test_overflowing_values_are_refused_naming_the_field(field, value, says):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}=.*{__import__('re').escape(says)}"):
        SamplingParams(**{field: value})


def test_the_range_ends_are_accepted():
    p = SamplingParams(length_penalty=10.0, top_p=sp._F32_TINY, logit_bias={3: 100, 4: -100.0},
                       repetition_penalty=0.01, temperature=2.0)
    assert (p.length_penalty, p.top_p, p.repetition_penalty, p.temperature) == (10.0, sp._F32_TINY, 0.01, 2.0)
    assert p.logit_bias == ((3, 100.0), (4, -100.0))
    q = SamplingParams(length_penalty=-10.0, repetition_penalty=100.0, num_beams=2, temperature=0.0)
    assert (q.length_penalty, q.repetition_penalty, q.num_beams) == (-10.0, 100.0, 2)
    # Why the ends are safe, in float32 as the sampler computes: top_p stays above 0, a
    # logit divided or multiplied by either repetition penalty stays finite, and
    # length ** length_penalty stays a normal number for every length up to 4096.
    f32 = torch.float32
    assert torch.tensor(p.top_p, dtype=f32) > 0
    big = torch.tensor(torch.finfo(f32).max / 1e4, dtype=f32)  # a large logit
    for penalty in (p.repetition_penalty, q.repetition_penalty):
        assert torch.isfinite(big / penalty) and torch.isfinite(big * penalty)
    lengths = torch.arange(1, 4097, dtype=f32)
    for lp in (p.length_penalty, q.length_penalty):
        powers = lengths ** lp
        assert torch.isfinite(powers).all() and (powers >= torch.finfo(f32).tiny).all()


@pytest.mark.parametrize("field, value, says", [
    ("bad_words_ids", [[1, 2]] * (sp.MAX_BAD_WORDS + 1), f"at most {sp.MAX_BAD_WORDS} entries"),
    ("bad_words_ids", [list(range(60))] * 2000, f"at most {sp.MAX_BAD_WORD_TOKENS} tokens"),
    ("logit_bias", {t: 1.0 for t in range(sp.MAX_LOGIT_BIAS + 1)}, f"at most {sp.MAX_LOGIT_BIAS} entries"),
    ("allowed_token_ids", list(range(sp.MAX_ALLOWED_TOKEN_IDS + 1)), f"at most {sp.MAX_ALLOWED_TOKEN_IDS}"),
    ("stop_token_ids", list(range(sp.MAX_TOKEN_ID_LIST + 1)), f"at most {sp.MAX_TOKEN_ID_LIST}"),
    ("suppress_tokens", list(range(sp.MAX_TOKEN_ID_LIST + 1)), f"at most {sp.MAX_TOKEN_ID_LIST}"),
    ("stop", ["x"] * (sp.MAX_STOP_STRINGS + 1), f"at most {sp.MAX_STOP_STRINGS} strings"),
    ("stop", ["y" * (sp.MAX_STOP_STRING_CHARS + 1)], f"at most {sp.MAX_STOP_STRING_CHARS} characters"),
])
def test_list_valued_fields_are_capped(field, value, says):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}=.*{says}"):
        SamplingParams(**{field: value})


def test_an_engine_seed_beyond_torchs_range_names_seed(bart_dir):
    with pytest.raises(ValueError, match=r"seed=18446744073709551616: .*2\*\*64 - 1"):
        LLM(model=str(bart_dir), dtype="float32", seed=2**64)


def test_the_most_probable_token_always_survives_top_p():
    scores = torch.tensor([[0.5, 3.0, 2.9, -1.0], [1.0, 1.0, 0.0, 0.0]])
    probs = sampling_probs(scores, [SamplingParams(top_p=sp._F32_TINY)] * 2)
    assert torch.equal(probs[0], torch.tensor([0.0, 1.0, 0.0, 0.0]))
    assert int((probs[1] > 0).sum()) == 1 and float(probs[1].sum()) == 1.0


@pytest.fixture(scope="module")
def llm(bart_dir):
    return LLM(model=str(bart_dir), dtype="float32", device="cpu")


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_a_request_whose_every_token_is_banned_ends_with_its_own_reason(llm, temperature):
    # Every id of the vocabulary suppressed. (allowed_token_ids=[7] with bad_words_ids=[[7]] is not
    # such a request: HF's prefix-constrained rule revives the allowed tokens when all were banned.)
    vocab = llm.engine.vocab_size
    banned = SamplingParams(temperature=temperature, max_tokens=5, suppress_tokens=list(range(vocab)),
                            logprobs=2, seed=1)
    revived = SamplingParams(temperature=temperature, max_tokens=3, allowed_token_ids=[7], bad_words_ids=[[7]],
                             ignore_eos=True, seed=1)
    later = SamplingParams(temperature=temperature, max_tokens=5, allowed_token_ids=[7, 8], ignore_eos=True,
                           suppress_tokens=[8], seed=1)  # only 7 left: fine
    good = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = llm.generate([PROMPT] * 4, [banned, later, good, revived], use_tqdm=False)
    c = outs[0].outputs[0]
    assert (c.token_ids, c.finish_reason, outs[0].error) == ([], "no_allowed_token", None)
    assert outs[1].outputs[0].token_ids == [7] * 5
    assert outs[3].outputs[0].token_ids == [7] * 3
    alone = llm.generate([PROMPT], good, use_tqdm=False)[0].outputs[0].token_ids
    assert outs[2].outputs[0].token_ids == alone
    s = llm.get_stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"]


def _strict(text: str):
    def refuse(name):
        raise AssertionError(f"{name} in JSON: {text[:200]}")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.asyncio
async def test_logprobs_of_banned_tokens_never_reach_json_as_infinity(bart_dir):
    engine = AsyncLLM(model=str(bart_dir), dtype="float32", device="cpu")
    app = build_app(engine, served_model_name="m")
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
            body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "allowed_token_ids": [5], "logprobs": 3,
                    "ignore_eos": True}
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            lp = _strict(r.text)["choices"][0]["logprobs"]
            assert lp["token_logprobs"] == [0.0, 0.0, 0.0]  # token 5 holds all the mass
            assert all(list(top.values()) == [0.0] for top in lp["top_logprobs"])  # the -inf ones left out
            r = await c.post("/v1/completions", json={**body, "stream": True})
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
            assert events and all(_strict(e) for e in events)
            # Every id banned: single-token bad words for all but EOS (HF keeps EOS out of those),
            # and EOS by min_tokens. (bad_words_ids=[[5]] beside allowed_token_ids=[5] is no such
            # request: HF's prefix-constrained rule revives the allowed tokens when all were banned.)
            vocab = engine.engine.vocab_size
            banned = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 3, "min_tokens": 3,
                      "bad_words_ids": [[t] for t in range(vocab)]}
            r = await c.post("/v1/completions", json=banned)
            # no_allowed_token is no OpenAI finish reason, and nothing was generated: a 400 naming why.
            error = _strict(r.text)["error"]
            assert (r.status_code, error["code"], error["type"]) == (400, 400, "invalid_request_error"), r.text
            assert "at the start of the output, every token is banned for this request" in error["message"]
    finally:
        await engine.shutdown(timeout=60)
