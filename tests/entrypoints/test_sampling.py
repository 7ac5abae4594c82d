"""Sampling parameters, stop conditions, logprobs and abort, checked against HF's model."""

import math

import pytest
import torch

from helpers import _hf_model
from tandem import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": [0, 5 + i, 20 + 2 * i, 40 + i, 2]} for i in range(6)]

# tandem's float32 logprobs against a float64 oracle. Float32 rounds at u = 6e-8; the
# fixture's wide random weights give activations up to ~1e2, so each dot product of
# length <= 64 may be off by u * 64 * 1e2 = 4e-4, and 2 encoder + 2 decoder layers with
# their layernorms compound that to ~1.5e-3 at worst. How the sums are split across
# threads moves the result within that bound (observed: ~1e-4), never beyond it.
LOGPROB_TOL = 2e-3


@pytest.fixture(scope="module")
def llm(bart_dir):
    return LLM(model=str(bart_dir), dtype="float32", device="cpu")


def _hf_logprobs(model_dir, enc, dec_full):
    """log_softmax of HF's next-token logits at every decoder position (one forward pass),
    computed in float64 so that the oracle carries no float32 rounding of its own."""
    model = _hf_model(model_dir, torch.float64)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([enc]), decoder_input_ids=torch.tensor([dec_full])).logits[0]
    return torch.log_softmax(logits, -1)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=1234, max_tokens=12)
    alone = llm.generate([PROMPTS[0]], p, use_tqdm=False)[0].outputs[0].token_ids
    batched = llm.generate(PROMPTS, p, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == batched
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=99, max_tokens=12)
    assert llm.generate([PROMPTS[0]] * 4, [p, p, other_seed, other_seed], use_tqdm=False)[0].outputs[0].token_ids == alone


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
    topk1 = llm.generate(PROMPTS, SamplingParams(temperature=0.8, top_k=1, max_tokens=10), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in topk1]


def test_sampled_tokens_respect_top_k(llm, bart_dir):
    p = SamplingParams(temperature=1.5, top_k=3, max_tokens=10, seed=7, logprobs=3)
    out = llm.generate(PROMPTS[:3], p, use_tqdm=False)
    for o in out:
        toks = o.outputs[0].token_ids
        ref = _hf_logprobs(bart_dir, o.encoder_prompt_token_ids, o.prompt_token_ids + toks)
        start = len(o.prompt_token_ids) - 1
        for j, t in enumerate(toks):
            top3 = ref[start + j].topk(3).indices.tolist()
            assert t in top3


def test_logprobs_match_hf_log_softmax(llm, bart_dir):
    out = llm.generate(PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=8, logprobs=2), use_tqdm=False)
    for o in out:
        c = o.outputs[0]
        ref = _hf_logprobs(bart_dir, o.encoder_prompt_token_ids, o.prompt_token_ids + c.token_ids)
        start = len(o.prompt_token_ids) - 1
        assert len(c.logprobs) == len(c.token_ids)
        total = 0.0
        for j, (t, lp) in enumerate(zip(c.token_ids, c.logprobs)):
            expect = ref[start + j]
            assert t in lp and len(lp) <= 3
            for tok, val in lp.items():
                assert math.isclose(val, float(expect[tok]), abs_tol=LOGPROB_TOL)
            assert set(expect.topk(2).indices.tolist()) <= set(lp)
            total += float(expect[t])
        assert math.isclose(c.cumulative_logprob, total, abs_tol=LOGPROB_TOL * len(c.token_ids))


def test_logprobs_only_for_requests_that_ask(llm, bart_dir):
    """Requests without ``logprobs`` skip the vocabulary logsumexp: no per-token
    logprobs and no cumulative log-probability; in the same batch, requests that
    ask get both, equal to the oracle's, and every request's tokens are unchanged."""
    asked = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)
    silent = SamplingParams(temperature=0.0, max_tokens=6)
    mixed = llm.generate(PROMPTS[:4], [asked, silent, asked, silent], use_tqdm=False)
    alone = llm.generate(PROMPTS[:4], asked, use_tqdm=False)
    for j, (m, a) in enumerate(zip(mixed, alone)):
        c = m.outputs[0]
        assert c.token_ids == a.outputs[0].token_ids
        if j % 2:
            assert c.logprobs is None and c.cumulative_logprob is None
        else:
            ref = _hf_logprobs(bart_dir, m.encoder_prompt_token_ids, m.prompt_token_ids + c.token_ids)
            start = len(m.prompt_token_ids) - 1
            total = sum(float(ref[start + i][t]) for i, t in enumerate(c.token_ids))
            assert [list(lp) for lp in c.logprobs] == [[t] for t in c.token_ids]
            assert math.isclose(c.cumulative_logprob, total, abs_tol=LOGPROB_TOL * len(c.token_ids))


def test_n_sequences_and_stop_token_ids(llm):
    p = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10)
    o = llm.generate([PROMPTS[1]], p, use_tqdm=False)[0]
    assert [c.index for c in o.outputs] == [0, 1, 2]
    assert all(1 <= len(c.token_ids) <= 10 for c in o.outputs)

    greedy = llm.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    toks = greedy.outputs[0].token_ids
    stop_tok = toks[3]
    first = toks.index(stop_tok)
    stopped = llm.generate(
        [PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_tok], ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert stopped.token_ids == toks[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_tok


def test_stop_strings_truncate_text(llm):
    tok = llm.get_tokenizer()
    p = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    full = llm.generate(["the rain in spain"], p, use_tqdm=False)[0].outputs[0]
    words = full.text.split()
    assert len(words) >= 4
    stop = words[2]
    cut = full.text.index(stop)
    out = llm.generate(["the rain in spain"], SamplingParams(temperature=0.0, max_tokens=12, stop=[stop], ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.text == full.text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert tok.decode(out.token_ids, skip_special_tokens=True).startswith(full.text[:cut].strip())


def test_abort_frees_blocks_and_keeps_others(llm):
    eng = llm.engine
    eng.add_request("keep", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=6))
    eng.add_request("drop", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    eng.step()
    aborted = eng.abort_request("drop")
    assert [a.request_id for a in aborted] == ["drop"] and aborted[0].outputs[0].finish_reason == "abort"
    done = []
    while eng.has_unfinished_requests():
        done += [o for o in eng.step() if o.finished]
    assert [d.request_id for d in done] == ["keep"]
    assert eng.block_manager.num_free_blocks() == eng.block_manager.num_total_blocks()


@pytest.fixture(scope="module")
def calm_dir(tmp_path_factory):
    from helpers import make_bart

    # Weights of std 1/sqrt(d_model), so activations stay O(1): the regime in which
    # helpers.BF16_LOGPROB_TOL is derived.
    return make_bart(tmp_path_factory.mktemp("calm") / "ckpt", seed=0, weight_std=32**-0.5)


def test_bfloat16_logprobs_and_tokens_match_the_float64_oracle(calm_dir):
    # Sampled bfloat16 tokens' log-probabilities against float64, greedy tokens against
    # float32's wherever the oracle's top two are far enough apart (helpers.py says why).
    from helpers import assert_bfloat16_agrees

    assert_bfloat16_agrees(calm_dir, PROMPTS)


def test_unseeded_sampling_follows_the_engine_seed(bart_dir):
    p = SamplingParams(temperature=1.0, max_tokens=10)

    def run(seed):
        torch.manual_seed(1234 + seed)  # the global RNG must not matter
        llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", seed=seed)
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, p, use_tqdm=False)]

    first = run(0)
    assert run(0) == first
    assert run(1) != first


def test_min_tokens_holds_back_eos_and_stop_tokens(llm):
    free = llm.generate([PROMPTS[3]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    toks = free[0].outputs[0].token_ids
    stop_tok = toks[0]
    out = llm.generate(
        [PROMPTS[3]],
        SamplingParams(temperature=0.0, max_tokens=12, min_tokens=5, stop_token_ids=[stop_tok]),
        use_tqdm=False,
    )[0].outputs[0]
    assert stop_tok not in out.token_ids[:5] and 2 not in out.token_ids[:5]
    assert len(out.token_ids) >= 5
    if stop_tok in out.token_ids:
        assert out.token_ids[-1] == stop_tok and out.finish_reason == "stop"
