"""tandem's tokens equal HF ``generate`` token for token, float32, many prompts batched."""

import random

import pytest

from helpers import WORDS, generate_preempted_and_ample, hf_greedy
from tandem import LLM, SamplingParams


def _prompts(seed: int, n: int, vocab: int = 96):
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        kind = i % 5
        if kind == 0:
            prompts.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))))
        elif kind == 1:
            prompts.append({"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))})
        elif kind == 2:
            ids = [rng.randrange(4, vocab) for _ in range(rng.randint(1, 90))]
            prompts.append({"prompt_token_ids": [0, *ids, 2]})
        elif kind == 3:
            dec = [rng.randrange(4, vocab) for _ in range(rng.randint(0, 5))]
            prompts.append(
                {
                    "encoder_prompt": {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(2, 30))]},
                    "decoder_prompt": {"prompt_token_ids": [0, *dec]},
                }
            )
        else:
            prompts.append(
                {
                    "encoder_prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20))),
                    "decoder_prompt": {"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))},
                }
            )
    return prompts


def _check_against_hf(model_dir, outs, max_tokens, min_tokens=0):
    for o in outs:
        assert o.error is None, o.error
        ref = hf_greedy(model_dir, o.encoder_prompt_token_ids, o.prompt_token_ids, max_tokens, min_tokens)
        assert o.outputs[0].token_ids == ref, (o.encoder_prompt_token_ids, o.prompt_token_ids)


@pytest.mark.parametrize("cross_views", [False, True])
@pytest.mark.slow
def test_mixed_prompts_match_hf(bart_dir, cross_views, monkeypatch):
    import tandem.backends.torch_sdpa as sdpa

    if cross_views:  # read every contiguous cross table through cache views
        monkeypatch.setattr(sdpa, "VIEW_MIN_CROSS_ELEMENTS", 1)
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu")
    prompts = _prompts(0, 24)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    assert len(outs) == len(prompts)
    _check_against_hf(bart_dir, outs, 24)
    reasons = {o.outputs[0].finish_reason for o in outs}
    assert reasons <= {"stop", "length"}
    # The fixture's outputs are varied; a degenerate model would make this test weak.
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 8


def test_prompt_formats_are_processed_as_documented(bart_dir):
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu")
    tok = llm.get_tokenizer()
    outs = llm.generate(
        [
            "the rain in spain falls mainly on the",
            {"prompt_token_ids": [0, 17, 5, 2]},
            {"encoder_prompt": {"prompt": "the rain in spain"}, "decoder_prompt": {"prompt_token_ids": [0, 51, 78]}},
            {"encoder_prompt": "the rain", "decoder_prompt": {"prompt_token_ids": [2, 0, 9]}},
            {"encoder_prompt": "the rain", "decoder_prompt": "red sun"},
        ],
        SamplingParams(temperature=0.0, max_tokens=4),
        use_tqdm=False,
    )
    a, b, c, d, e = outs
    assert a.encoder_prompt == "the rain in spain falls mainly on the"
    assert a.encoder_prompt_token_ids == tok("the rain in spain falls mainly on the")["input_ids"]
    assert a.prompt_token_ids == [2, 0] and a.prompt is None
    assert b.encoder_prompt_token_ids == [0, 17, 5, 2] and b.encoder_prompt is None
    assert b.prompt_token_ids == [2, 0]
    assert c.encoder_prompt == "the rain in spain"
    assert c.prompt_token_ids == [2, 0, 51, 78]
    assert d.prompt_token_ids == [2, 0, 9]  # already starts with <DEC>: unchanged
    red, sun = tok.convert_tokens_to_ids(["red", "sun"])
    assert e.prompt == "red sun" and e.prompt_token_ids == [2, 0, red, sun]
    for o in outs:
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.slow
def test_block_sizes_and_min_tokens_match_hf(bart_dir, block_size):
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", block_size=block_size)
    prompts = _prompts(1, 10)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, min_tokens=5), use_tqdm=False)
    _check_against_hf(bart_dir, outs, 12, 5)
    assert all(len(o.outputs[0].token_ids) >= 5 for o in outs)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.slow
def test_preemption_keeps_outputs_identical(bart_dir, mode):
    prompts = _prompts(2, 16)
    params = SamplingParams(temperature=0.0, max_tokens=40, min_tokens=40)
    outs, ref = generate_preempted_and_ample(bart_dir, prompts, params, mode)
    for o, r in zip(outs, ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        assert len(o.outputs[0].token_ids) == 40
    # and the unpreempted run is itself HF's answer
    _check_against_hf(bart_dir, ref[:4], 40, 40)


@pytest.mark.parametrize("zero_logits_bias", [True, False])
@pytest.mark.slow
def test_large_vocabulary_and_zero_logits_bias_match_hf(tmp_path, zero_logits_bias):
    """A vocabulary large enough for the sampler's chunked argmax (many chunks and a
    tail), and BART's usual all-zero final_logits_bias, which the LM head then skips."""
    from helpers import make_bart

    model_dir = make_bart(tmp_path / "ckpt", seed=3, with_tokenizer=False, vocab_size=5000,
                          logits_bias_std=0.0 if zero_logits_bias else 1.0)
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu")
    assert llm.engine.worker.model.logits_bias_nonzero is (not zero_logits_bias)
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [0, *(rng.randrange(4, 5000) for _ in range(rng.randint(1, 30))), 2]}
               for _ in range(12)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
    _check_against_hf(model_dir, outs, 10)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 6
