"""Each logits processor against HF ``generate`` (greedy, and inside beam search),
all of them in one batch with different settings per request; the OpenAI-style
ones HF lacks against a plain per-row reference run inside HF ``generate``."""

import random

import pytest
import torch

from helpers import hf_search
from tandem import LLM, SamplingParams

MAX_NEW = 14


def _prompts(seed: int, n: int, vocab: int = 96) -> list[list[int]]:
    rng = random.Random(seed)
    return [[0] + [rng.randrange(4, vocab) for _ in range(rng.randint(2, 25))] + [2] for _ in range(n)]


# (tandem SamplingParams fields, HF generate kwargs) per processor, chosen so each fires
# on the tiny checkpoint (whose greedy outputs repeat tokens and stop early).
CASES = {
    "repetition_penalty": (dict(repetition_penalty=1.8), dict(repetition_penalty=1.8)),
    "repetition_penalty_below_1": (dict(repetition_penalty=0.6), dict(repetition_penalty=0.6)),
    "no_repeat_ngram_size_1": (dict(no_repeat_ngram_size=1), dict(no_repeat_ngram_size=1)),
    "no_repeat_ngram_size_2": (dict(no_repeat_ngram_size=2), dict(no_repeat_ngram_size=2)),
    "no_repeat_ngram_size_3": (dict(no_repeat_ngram_size=3), dict(no_repeat_ngram_size=3)),
    "min_tokens": (dict(min_tokens=9), dict(min_new_tokens=9)),
    "min_length": (dict(min_length=7), dict(min_length=7)),
    "forced_eos_token_id": (dict(forced_eos_token_id=2), dict(forced_eos_token_id=2)),
    "suppress_tokens": (dict(suppress_tokens=[63, 92, 18, 14]), dict(suppress_tokens=[63, 92, 18, 14])),
    "begin_suppress_tokens": (dict(begin_suppress_tokens=[63, 92, 2]), dict(begin_suppress_tokens=[63, 92, 2])),
    "bad_words_single": (dict(bad_words_ids=[[63], [92], [2]]), dict(bad_words_ids=[[63], [92], [2]])),
    "bad_words_multi": (
        dict(bad_words_ids=[[92, 92], [63, 63], [18, 92], [91, 63, 14]]),
        dict(bad_words_ids=[[92, 92], [63, 63], [18, 92], [91, 63, 14]]),
    ),
    "combined": (
        dict(repetition_penalty=1.3, no_repeat_ngram_size=2, min_tokens=5, suppress_tokens=[14],
             bad_words_ids=[[63, 92]], forced_eos_token_id=2),
        dict(repetition_penalty=1.3, no_repeat_ngram_size=2, min_new_tokens=5, suppress_tokens=[14],
             bad_words_ids=[[63, 92]], forced_eos_token_id=2),
    ),
}


@pytest.fixture(scope="module")
def llm(bart_dir):
    return LLM(model=str(bart_dir), dtype="float32", device="cpu")


@pytest.mark.slow
def test_every_processor_in_one_batch_equals_hf_greedy(llm, bart_dir):
    prompts = _prompts(1, 2) + _prompts(10, 2)  # some run to the length limit, some stop early
    names = list(CASES)
    batch, params = [], []
    for name in names:
        for p in prompts:
            batch.append({"prompt_token_ids": p})
            params.append(SamplingParams(temperature=0.0, max_tokens=MAX_NEW, **CASES[name][0]))
    # Plain greedy rows in the same batch must be untouched by their neighbours' processors.
    for p in prompts:
        batch.append({"prompt_token_ids": p})
        params.append(SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    outs = llm.generate(batch, params, use_tqdm=False)
    changed = set()
    for k, out in enumerate(outs):
        name = names[k // len(prompts)] if k < len(names) * len(prompts) else None
        prompt = prompts[k % len(prompts)]
        kwargs = CASES[name][1] if name else {}
        ref = hf_search(bart_dir, prompt, [2, 0], do_sample=False, num_beams=1, max_new_tokens=MAX_NEW, **kwargs)
        assert out.error is None, out.error
        assert out.outputs[0].token_ids == ref[0][0], (name, prompt)
        plain = hf_search(bart_dir, prompt, [2, 0], do_sample=False, num_beams=1, max_new_tokens=MAX_NEW)
        if name and ref[0][0] != plain[0][0]:
            changed.add(name)
    # Each processor changed at least one output: none of these comparisons is vacuous.
    assert changed == set(names)


def test_forced_bos_from_a_decoder_start_only_prompt(llm, bart_dir):
    prompts = _prompts(2, 3)
    params = SamplingParams(temperature=0.0, max_tokens=8, forced_bos_token_id=17)
    outs = llm.generate([{"encoder_prompt": {"prompt_token_ids": p}, "decoder_prompt": {"prompt_token_ids": [2]}}
                         for p in prompts], params, use_tqdm=False)
    for p, out in zip(prompts, outs):
        ref = hf_search(bart_dir, p, [2], do_sample=False, num_beams=1, max_new_tokens=8, forced_bos_token_id=17)
        assert out.outputs[0].token_ids == ref[0][0]
        assert out.outputs[0].token_ids[0] == 17


@pytest.mark.parametrize("name", ["repetition_penalty", "no_repeat_ngram_size_2", "min_tokens", "bad_words_multi",
                                  "begin_suppress_tokens", "combined"])
def test_processors_inside_beam_search_equal_hf(llm, bart_dir, name):
    ours, theirs = CASES[name]
    prompts = _prompts(3, 3)
    params = SamplingParams(num_beams=3, n=2, max_tokens=MAX_NEW, **ours)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, out in zip(prompts, outs):
        ref = hf_search(bart_dir, p, [2, 0], do_sample=False, num_beams=3, num_return_sequences=2,
                        max_new_tokens=MAX_NEW, **theirs)
        for got, (tokens, score) in zip(out.outputs, ref):
            assert got.token_ids == tokens
            assert got.cumulative_logprob == pytest.approx(score, rel=1e-4, abs=1e-4)


class _OpenAIReference:
    """HF LogitsProcessor doing, row by row in float64, what the OpenAI API
    documents: logits[t] -= count(t) * frequency + (count(t) > 0) * presence over
    the output tokens; logit_bias added; tokens outside allowed_token_ids banned."""

    def __init__(self, prompt_len, presence=0.0, frequency=0.0, bias=None, allowed=None):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency
        self.bias, self.allowed = bias or {}, allowed

    def __call__(self, input_ids, scores):
        out = scores.double().clone()
        for r in range(out.shape[0]):
            if self.allowed is not None:
                mask = torch.ones(out.shape[1], dtype=torch.bool)
                mask[list(self.allowed)] = False
                out[r, mask] = -float("inf")
            for t, b in self.bias.items():
                out[r, t] += b
            counts: dict[int, int] = {}
            for t in input_ids[r, self.prompt_len:].tolist():
                counts[t] = counts.get(t, 0) + 1
            for t, c in counts.items():
                out[r, t] -= c * self.frequency + self.presence
        return out.to(scores.dtype)


@pytest.mark.parametrize(
    "ours",
    [
        dict(presence_penalty=1.5),
        dict(frequency_penalty=0.9),
        dict(presence_penalty=-0.5, frequency_penalty=1.2),
        dict(logit_bias={5: 3.0, 63: -4.0, 17: 2.5}),
        dict(allowed_token_ids=[2, 5, 9, 17, 40, 63, 77]),
    ],
)
def test_openai_processors_equal_a_per_row_reference(llm, bart_dir, ours):
    from transformers import LogitsProcessorList

    prompts = _prompts(4, 3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, **ours), use_tqdm=False)
    ref_proc = _OpenAIReference(
        2, ours.get("presence_penalty", 0.0), ours.get("frequency_penalty", 0.0), ours.get("logit_bias"),
        ours.get("allowed_token_ids"),
    )
    changed = False
    for p, out in zip(prompts, outs):
        ref = hf_search(bart_dir, p, [2, 0], do_sample=False, num_beams=1, max_new_tokens=MAX_NEW,
                        logits_processor=LogitsProcessorList([ref_proc]))
        plain = hf_search(bart_dir, p, [2, 0], do_sample=False, num_beams=1, max_new_tokens=MAX_NEW)
        assert out.outputs[0].token_ids == ref[0][0]
        changed |= ref[0][0] != plain[0][0]
        if "allowed_token_ids" in ours:
            assert set(out.outputs[0].token_ids) <= set(ours["allowed_token_ids"])
    assert changed


def test_user_logits_processors_with_both_signatures(llm, bart_dir):
    from transformers import LogitsProcessorList

    def ban_last(output_ids, logits):  # vLLM's two-argument form
        if output_ids:
            logits[output_ids[-1]] = -float("inf")
        return logits

    def prefer_prompt_tokens(prompt_ids, output_ids, logits):  # the three-argument form
        logits[prompt_ids[-1]] += 2.0
        return logits

    class HFEquivalent:
        def __call__(self, input_ids, scores):
            scores = scores.clone()
            for r in range(scores.shape[0]):
                if input_ids.shape[1] > 2:
                    scores[r, input_ids[r, -1]] = -float("inf")
                scores[r, 0] += 2.0
            return scores

    prompts = _prompts(5, 3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW,
                                       logits_processors=[ban_last, prefer_prompt_tokens]), use_tqdm=False)
    for p, out in zip(prompts, outs):
        ref = hf_search(bart_dir, p, [2, 0], do_sample=False, num_beams=1, max_new_tokens=MAX_NEW,
                        logits_processor=LogitsProcessorList([HFEquivalent()]))
        assert out.outputs[0].token_ids == ref[0][0]
        toks = out.outputs[0].token_ids
        assert all(a != b for a, b in zip(toks, toks[1:]))


def test_processor_token_ids_are_checked_against_the_vocabulary(llm):
    outs = llm.generate(
        [{"prompt_token_ids": [0, 5, 2]}] * 4,
        [SamplingParams(suppress_tokens=[96]), SamplingParams(logit_bias={1000: 1.0}),
         SamplingParams(allowed_token_ids=[3, 200]), SamplingParams(temperature=0.0, max_tokens=3)],
        use_tqdm=False,
    )
    assert "suppress_tokens" in outs[0].error and "96" in outs[0].error
    assert "logit_bias" in outs[1].error and "1000" in outs[1].error
    assert "allowed_token_ids" in outs[2].error and "200" in outs[2].error
    assert outs[3].error is None
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0.0)
    with pytest.raises(TypeError, match="logits_processors"):
        SamplingParams(logits_processors=[3])
    with pytest.raises(ValueError, match="bad_words_ids"):
        SamplingParams(bad_words_ids=[[]])


def test_a_raising_user_processor_fails_only_its_request(llm, bart_dir):
    def broken(output_ids, logits):
        if len(output_ids) == 3:
            raise ValueError("bad state")
        return logits

    prompts = _prompts(6, 3)
    params = [SamplingParams(temperature=0.0, max_tokens=8),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logits_processors=[broken]),
              SamplingParams(temperature=0.0, max_tokens=8)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert "logits processor 'broken' raised ValueError: bad state" in outs[1].error
    for i in (0, 2):
        ref = hf_search(bart_dir, prompts[i], [2, 0], do_sample=False, num_beams=1, max_new_tokens=8)
        assert outs[i].error is None and outs[i].outputs[0].token_ids == ref[0][0]
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
