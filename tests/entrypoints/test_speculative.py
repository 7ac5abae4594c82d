"""Speculative decoding end to end: greedy outputs with speculation equal those
without, token for token (batched, mixed lengths and processors, under
preemption by recompute and by swap, on BART and T5, and on the shipped demo
model where drafts are accepted most of the time); the requests that do not
speculate run unchanged; the counters reach ``get_stats`` and ``/metrics``.

The oracle is the same engine without ``speculative_config``. Both compute the
same float32 functions, but a verified chunk goes through the multi-token
attention path and a plain step through the one-token path, whose sums differ
in order: logits agree to ~1e-5, so a greedy choice could differ only on a
near tie (none occurs in these fixtures: the tests would show it), and
log-probabilities are compared to 1e-4 (float32 sums over <= 64 keys and a
96-token vocabulary, with the wide random weights' logits of ~1e2: a few ulps
of 1e2 is ~1e-5).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import assert_preempted, make_bart, make_t5
from tandem import LLM, SamplingParams
from tandem.entrypoints.cli import DEMO_MODEL

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def bart(tmp_path_factory) -> Path:
    return make_bart(tmp_path_factory.mktemp("bart"))


def prompts(count: int = 8) -> list[dict]:
    # Repeated n-grams in the encoder input, of mixed lengths, so lookups hit.
    out = []
    for i in range(count):
        words = [5 + (i * 7 + j) % 40 for j in range(3 + i % 5)]
        out.append({"prompt_token_ids": [0] + words * (2 + i % 3) + [2]})
    return out


PARAMS = [
    SamplingParams(max_tokens=24, temperature=0),
    SamplingParams(max_tokens=17, temperature=0, logprobs=2),
    SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.3, presence_penalty=0.5),
    SamplingParams(max_tokens=20, temperature=0, min_tokens=6, stop_token_ids=[63, 92]),
    SamplingParams(max_tokens=20, temperature=0, no_repeat_ngram_size=3),
    SamplingParams(max_tokens=20, temperature=0, bad_words_ids=[[63, 63], [92]], frequency_penalty=0.3),
    SamplingParams(max_tokens=5, temperature=0),
    SamplingParams(max_tokens=20, temperature=0, min_tokens=8, ignore_eos=False),
]


def run(model: Path, params, spec=None, **kw):
    llm = LLM(str(model), device="cpu", dtype="float32", block_size=4, speculative_config=spec, **kw)
    outs = llm.generate(prompts(len(params) if isinstance(params, list) else 8), params, use_tqdm=False)
    return llm, outs


def assert_same(outs, ref) -> None:
    for o, r in zip(outs, ref):
        for c, rc in zip(o.outputs, r.outputs, strict=True):
            assert c.token_ids == rc.token_ids, o.request_id
            assert c.finish_reason == rc.finish_reason and c.stop_reason == rc.stop_reason
            if rc.logprobs is not None:
                assert len(c.logprobs) == len(rc.logprobs)
                for a, b in zip(c.logprobs, rc.logprobs):
                    assert a.keys() == b.keys()
                    assert all(abs(a[t] - b[t]) <= LOGPROB_TOL for t in a)


def test_greedy_equals_plain_batched_with_processors(bart):
    _, ref = run(bart, PARAMS)
    llm, outs = run(bart, PARAMS, SPEC)
    assert_same(outs, ref)
    stats = llm.get_stats()
    # The fixture exercises acceptance, not only rejection.
    assert stats["spec_draft_tokens"] > 0 and 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    assert stats["spec_acceptance_rate"] == stats["spec_accepted_tokens"] / stats["spec_draft_tokens"]
    assert stats["spec_mean_accepted_length"] == 1 + stats["spec_accepted_tokens"] / stats["spec_verify_steps"]
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_min_tokens_boundary_inside_a_verified_chunk(bart):
    """min_tokens bans the stop tokens up to a count of output tokens; with every
    boundary from 2 to 9 some falls inside a chunk of drafts, whose rows must each
    count their own output length."""
    params = [SamplingParams(max_tokens=14, temperature=0, min_tokens=m, stop_token_ids=[63, 92]) for m in range(2, 10)]
    _, ref = run(bart, params)
    llm, outs = run(bart, params, SPEC)
    assert_same(outs, ref)
    assert llm.get_stats()["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("k", [1, 5])
def test_greedy_equals_plain_for_other_k_and_lookup(bart, k):
    params = SamplingParams(max_tokens=30, temperature=0)
    _, ref = run(bart, params)
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 2, "prompt_lookup_min": 2}
    llm, outs = run(bart, params, spec)
    assert_same(outs, ref)
    assert llm.get_stats()["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_equals_plain_under_preemption(bart, mode):
    params = SamplingParams(max_tokens=30, temperature=0, n=2 if mode == "swap" else 1)
    _, ref = run(bart, params)
    llm, outs = run(bart, params, SPEC, num_kv_blocks=40, preemption_mode=mode)
    assert_preempted(llm, mode)
    assert_same(outs, ref)
    stats = llm.get_stats()
    assert stats["spec_accepted_tokens"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_t5_greedy_equals_plain(tmp_path):
    t5 = make_t5("t5-small", tmp_path / "t5")
    params = SamplingParams(max_tokens=24, temperature=0)
    _, ref = run(t5, params)
    llm, outs = run(t5, params, SPEC)
    assert_same(outs, ref)
    assert llm.get_stats()["spec_draft_tokens"] > 0


def test_demo_model_copies_palindromes_with_most_drafts_accepted():
    """The demo model reverses the words of a sentence; a palindrome's reversal is a
    copy of its input, which prompt lookup proposes: most drafts are accepted."""
    words = ["the", "cat", "sat", "on", "red", "mat", "dog", "ran"]
    sentences = [" ".join(words[i:i + 3] + words[i:i + 3][::-1]) for i in range(5)] + ["a big dog big a"]
    params = SamplingParams(max_tokens=16, temperature=0)
    base = LLM(str(DEMO_MODEL), device="cpu", dtype="float32")
    ref = base.generate(sentences, params, use_tqdm=False)
    spec = LLM(str(DEMO_MODEL), device="cpu", dtype="float32",
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2})
    outs = spec.generate(sentences, params, use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in ref]
    assert [o.outputs[0].text for o in ref][0] == sentences[0]  # the model does copy them
    assert spec.get_stats()["spec_acceptance_rate"] > 0.5


def test_requests_that_do_not_speculate_run_unchanged(bart):
    """Beam search and user logits processors run without drafts (and the same as
    without speculation); the counters do not move for them."""
    beam = SamplingParams(max_tokens=12, temperature=0, num_beams=3, n=2)

    def double_63(out_ids, logits):
        logits[63] = logits[63] * 2
        return logits

    user = SamplingParams(max_tokens=12, temperature=0, logits_processors=[double_63])
    for params in (beam, user):
        _, ref = run(bart, params)
        llm, outs = run(bart, params, SPEC)
        assert_same(outs, ref)
        assert llm.get_stats()["spec_draft_tokens"] == 0


def test_sampled_requests_finish_and_free_every_block(bart):
    """Sampled rows go through rejection sampling (its distribution is
    tests/core/test_speculative_distribution.py's); here: lengths, seeds and blocks."""
    params = SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=7, n=2, logprobs=1)
    llm, outs = run(bart, params, SPEC)
    again = run(bart, params, SPEC)[1]
    for o, a in zip(outs, again):  # a seeded request repeats itself under the same config
        assert [c.token_ids for c in o.outputs] == [c.token_ids for c in a.outputs]
        for c in o.outputs:
            assert len(c.token_ids) <= 20 and len(c.logprobs) == len(c.token_ids)
            assert all(t in lp for t, lp in zip(c.token_ids, c.logprobs))
    stats = llm.get_stats()
    assert stats["spec_draft_tokens"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_seeded_samples_equal_plain_sampling_alone_batched_or_preempted(bart):
    """A seeded request's samples (n > 1) are those it draws without speculation, run
    alone, beside other sampled requests, and through a pool that preempts (which drops
    drafts): each emitted token is plain sampling's draw from its sequence's own stream,
    whatever drafts the step verified (``verify.py``), so neither the drafts the
    scheduler gave or dropped nor the rest of the batch moves its stream."""
    seeded = [SamplingParams(max_tokens=24, temperature=0.8, top_k=20, seed=seed, n=2) for seed in range(4)]
    others = [SamplingParams(max_tokens=24, temperature=1.0, n=3), SamplingParams(max_tokens=20, temperature=0),
              SamplingParams(max_tokens=24, temperature=0.7, seed=99), SamplingParams(max_tokens=24, temperature=1.2)]
    _, plain = run(bart, seeded)
    llm, alone = run(bart, seeded, SPEC)
    assert llm.get_stats()["spec_accepted_tokens"] > 0
    _, beside = run(bart, seeded + others, SPEC)
    preempting, squeezed = run(bart, seeded + others, SPEC, num_kv_blocks=40, preemption_mode="recompute")
    assert_preempted(preempting, "recompute")
    want = [[c.token_ids for c in o.outputs] for o in plain]
    for outs in (alone, beside[:4], squeezed[:4]):
        assert [[c.token_ids for c in o.outputs] for o in outs] == want
    assert len({len(t) for w in want for t in w}) > 2 and any(w[0] != w[1] for w in want)  # not degenerate


def test_metrics_show_the_engines_speculation_counters(bart):
    """``/metrics`` reads the snapshot ``get_stats`` returns: the same numbers."""
    from prometheus_client import generate_latest

    from tandem.entrypoints.openai.metrics import ServerMetrics

    llm, _ = run(bart, SamplingParams(max_tokens=24, temperature=0), SPEC)
    stats = llm.get_stats()
    text = generate_latest(ServerMetrics(llm.llm_engine).registry).decode()
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in text.splitlines() if line and not line.startswith("#")}
    assert samples["tandem:spec_decode_num_draft_tokens_total"] == stats["spec_draft_tokens"] > 0
    assert samples["tandem:spec_decode_num_accepted_tokens_total"] == stats["spec_accepted_tokens"] > 0
    assert samples["tandem:spec_decode_acceptance_rate"] == pytest.approx(stats["spec_acceptance_rate"])
    assert samples["tandem:spec_decode_mean_accepted_length"] == pytest.approx(stats["spec_mean_accepted_length"])


def test_structured_requests_beside_speculating_ones_keep_their_masks(tmp_path):
    """A structured request does not speculate; its mask rows are counted past the
    speculating requests' several rows per sequence, so it stays in its grammar and
    both kinds give what they give without speculation."""
    pytest.importorskip("xgrammar")
    from helpers import make_bart_bytes
    from tandem import StructuredOutputsParams

    model = make_bart_bytes(tmp_path / "bytes", seed=0, head_padding=8)
    regex = r"(ab|c)[0-9]{2,4}-(yes|no)"
    plain = SamplingParams(temperature=0, max_tokens=24)
    structured = SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=regex))
    texts = ["abab abab abab", "the rain the rain the rain", "xyz xyz xyz xyz", "cat cat cat"]
    params = [plain, plain, structured, plain, structured]
    prompts = (texts * 2)[: len(params)]
    outs = {}
    for spec in (None, SPEC):
        llm = LLM(str(model), device="cpu", dtype="float32", speculative_config=spec)
        outs[spec is None] = llm.generate(prompts, params, use_tqdm=False)
    assert llm.get_stats()["spec_accepted_tokens"] > 0
    for o, r, p in zip(outs[False], outs[True], params):
        assert o.error is None and o.outputs[0].token_ids == r.outputs[0].token_ids
        if p is structured:
            import re

            assert re.fullmatch(regex, o.outputs[0].text)


def test_whisper_language_slot_then_speculation_equals_plain(tmp_path):
    """Whisper: audio features (no encoder token ids: lookups in the decoder's own
    tokens only), the language slot filled first, then speculation."""
    from helpers import make_whisper, synth_audio

    path = make_whisper(tmp_path / "whisper", num_mel_bins=80, seed=80)
    clips = [synth_audio(s, seed=10 + i) for i, s in enumerate([1.5, 7.0, 12.3])]
    res = {}
    for spec in (None, SPEC):
        llm = LLM(str(path), dtype="float32", device="cpu", speculative_config=spec)
        res[spec is None] = llm.transcribe(clips, sampling_rate=16000, use_tqdm=False)
    for a, b in zip(res[False], res[True]):
        assert (a.language, a.text) == (b.language, b.text)
    assert llm.get_stats()["spec_draft_tokens"] > 0
