"""Speculative decoding with a draft model (``speculative_config={"model": DIR, ...}``):
greedy outputs equal those without speculation and HF ``generate``'s, token for
token, batched with mixed lengths and processors and under preemption, with a
draft that is another random checkpoint (drafts mostly rejected) and with the
target itself as its draft (drafts all accepted); the draft never recomputes
its decoder history, and preemption, abort and finish leave none of its blocks
or worker state behind; a bad draft checkpoint is refused at construction.

Oracles: HF ``generate`` (greedy) and the same engine without speculation. The
float32 tolerance argument is ``test_speculative.py``'s: a verified chunk and a
plain step sum in different orders (logits agree to ~1e-5), so only a near tie
could tip a greedy choice, and none occurs in these fixtures.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import assert_preempted, hf_greedy, make_bart
from tandem import LLM, SamplingParams
from tandem.core.scheduler_output import SchedulerOutput

K = 3


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_bart(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def other(tmp_path_factory) -> Path:
    """A different random checkpoint with the target's vocabulary: one layer each side."""
    return make_bart(tmp_path_factory.mktemp("draft"), seed=1, encoder_layers=1, decoder_layers=1)


def prompts(count: int) -> list[dict]:
    # Mixed encoder lengths (5 to 22 tokens).
    return [{"prompt_token_ids": [0] + [5 + (i * 7 + j) % 40 for j in range(3 + i % 5)] * (1 + i % 3) + [2]}
            for i in range(count)]


PARAMS = [
    SamplingParams(max_tokens=24, temperature=0),
    SamplingParams(max_tokens=17, temperature=0, logprobs=2),
    SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.3, presence_penalty=0.5),
    SamplingParams(max_tokens=20, temperature=0, min_tokens=6, stop_token_ids=[63, 92]),
    SamplingParams(max_tokens=20, temperature=0, no_repeat_ngram_size=3),
    SamplingParams(max_tokens=5, temperature=0),
]


def spec(draft: Path, k: int = K) -> dict:
    return {"model": str(draft), "num_speculative_tokens": k}


def run(model: Path, params, speculative_config=None, count: int | None = None, **kw):
    llm = LLM(str(model), device="cpu", dtype="float32", block_size=4, speculative_config=speculative_config, **kw)
    n = len(params) if isinstance(params, list) else count
    return llm, llm.generate(prompts(n), params, use_tqdm=False)


def assert_same(outs, ref) -> None:
    for o, r in zip(outs, ref, strict=True):
        for c, rc in zip(o.outputs, r.outputs, strict=True):
            assert c.token_ids == rc.token_ids, o.request_id
            assert c.finish_reason == rc.finish_reason
            if rc.logprobs is not None:  # 1e-4: test_speculative.py's LOGPROB_TOL and its argument
                for a, b in zip(c.logprobs, rc.logprobs, strict=True):
                    assert a.keys() == b.keys() and all(abs(a[t] - b[t]) <= 1e-4 for t in a)


def assert_draft_left_nothing(llm) -> None:
    """Every block of both pools free; the draft holds no request and its worker no
    request, sequence or block-table row."""
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    draft = llm.llm_engine.draft
    bm = draft.block_manager
    assert bm.num_free_blocks() == bm.num_total_blocks()
    assert draft.num_requests == 0 and not draft.worker.requests
    assert not draft.worker.runner.tables._row and not draft.worker.runner.cross_tables._row


def watch_draft_forwards(llm) -> list[SchedulerOutput]:
    """Record every SchedulerOutput the draft's worker runs."""
    worker = llm.llm_engine.draft.worker
    seen, run_model = [], worker.execute_model

    def record(out):
        seen.append(out)
        return run_model(out)

    worker.execute_model = record
    return seen


@pytest.mark.parametrize("which", ["other", "itself"])
def test_greedy_equals_plain_and_hf(target, other, which):
    draft = other if which == "other" else target
    _, ref = run(target, PARAMS)
    llm, outs = run(target, PARAMS, spec(draft))
    assert_same(outs, ref)
    for i in (0, 5):  # the independent oracle, for the plain requests (24 and 5 tokens)
        o = outs[i]
        hf = hf_greedy(target, o.encoder_prompt_token_ids, o.prompt_token_ids, PARAMS[i].max_tokens)
        assert o.outputs[0].token_ids == hf
    stats = llm.get_stats()
    assert stats["spec_draft_tokens"] > 0
    # Itself: it proposes the target's raw argmax, which the processed rows (penalties,
    # n-gram bans) reject at times; plain requests accept all (the next test).
    assert (stats["spec_acceptance_rate"] > 0.5) == (which == "itself")
    assert_draft_left_nothing(llm)


def test_draft_runs_its_encoder_once_and_never_recomputes_its_history(target, other):
    """Each draft forward feeds a sequence at most two tokens (the target's new token,
    and the last draft when all were accepted) unless the sequence is new to the
    draft (its decoder prompt so far); each request's encoder runs once."""
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)  # every request speculates
    llm = LLM(str(target), device="cpu", dtype="float32", block_size=4, speculative_config=spec(target))
    seen = watch_draft_forwards(llm)
    llm.generate(prompts(5), params, use_tqdm=False)
    stats = llm.get_stats()  # the target proposing for itself: every draft accepted
    assert stats["spec_acceptance_rate"] == 1.0 and stats["spec_mean_accepted_length"] > K
    fed = [(s.num_computed_tokens, len(s.token_ids)) for out in seen for g in out.scheduled for s in g.seqs]
    assert fed and all(n <= 2 for computed, n in fed if computed > 0)
    assert sum(computed == 0 for computed, _ in fed) == 5  # one admission per request
    encoders = [g.request_id for out in seen for g in out.scheduled if g.run_encoder]
    assert sorted(encoders) == sorted(set(encoders)) and len(encoders) == 5
    assert_draft_left_nothing(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_equals_plain_under_preemption(target, other, mode):
    params = SamplingParams(max_tokens=30, temperature=0, n=2 if mode == "swap" else 1)
    _, ref = run(target, params, count=8)
    llm, outs = run(target, params, spec(other), count=8, num_kv_blocks=40, preemption_mode=mode)
    assert_preempted(llm, mode)
    assert_same(outs, ref)
    assert llm.get_stats()["spec_accepted_tokens"] > 0
    assert_draft_left_nothing(llm)


def test_abort_frees_the_drafts_state(target):
    llm = LLM(str(target), device="cpu", dtype="float32", block_size=4, speculative_config=spec(target))
    engine = llm.llm_engine
    for i, p in enumerate(prompts(4)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.draft.num_requests == 4
    engine.abort_request(["0", "2"])
    assert engine.draft.num_requests == 2 and set(engine.draft.worker.requests) == {"1", "3"}
    engine.abort_request(["1", "3"])
    assert_draft_left_nothing(llm)


def test_requests_that_do_not_speculate_run_unchanged(target, other):
    """Beam search and user logits processors run without drafts, as without speculation."""
    def double_63(out_ids, logits):
        logits[63] = logits[63] * 2
        return logits

    for params in (SamplingParams(max_tokens=12, temperature=0, num_beams=3, n=2),
                   SamplingParams(max_tokens=12, temperature=0, logits_processors=[double_63])):
        _, ref = run(target, params, count=3)
        llm, outs = run(target, params, spec(other), count=3)
        assert_same(outs, ref)
        assert llm.get_stats()["spec_draft_tokens"] == 0 and llm.llm_engine.draft.num_requests == 0


def test_sampled_requests_repeat_under_a_seed_and_free_every_block(target, other):
    """Sampled rows go through the rejection sampling of verify.py, whose distribution
    tests/core/test_speculative_distribution.py checks; a greedy draft is a point-mass
    proposal, the case it covers. Here: seeds, lengths, blocks."""
    params = SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=7, n=2)
    llm, outs = run(target, params, spec(target), count=3)
    again = run(target, params, spec(target), count=3)[1]
    for o, a in zip(outs, again):
        assert [c.token_ids for c in o.outputs] == [c.token_ids for c in a.outputs]
        assert all(len(c.token_ids) <= 20 for c in o.outputs)
    assert llm.get_stats()["spec_accepted_tokens"] > 0
    assert_draft_left_nothing(llm)


def test_a_failing_draft_forward_leaves_the_step_without_drafts(target, other):
    params = SamplingParams(max_tokens=20, temperature=0)
    _, ref = run(target, params, count=4)
    llm = LLM(str(target), device="cpu", dtype="float32", block_size=4, speculative_config=spec(other))
    worker, calls = llm.llm_engine.draft.worker, []
    run_model = worker.execute_model

    def fail_third(out):
        calls.append(out)
        if len(calls) == 3:
            raise RuntimeError("draft device lost")
        return run_model(out)

    worker.execute_model = fail_third
    outs = llm.generate(prompts(4), params, use_tqdm=False)
    assert_same(outs, ref)
    assert llm.llm_engine.draft.failures == 1 and all(o.error is None for o in outs)
    assert_draft_left_nothing(llm)


def test_bad_drafts_are_refused_at_construction(target, tmp_path):
    def build(draft):
        return LLM(str(target), device="cpu", dtype="float32", speculative_config=spec(draft))

    small = make_bart(tmp_path / "v64", vocab_size=64)
    with pytest.raises(ValueError, match=r"model='.*v64'.*vocab_size is 64 but the target's is 96"):
        build(small)
    eos = make_bart(tmp_path / "eos", eos_token_id=3, with_tokenizer=False)
    with pytest.raises(ValueError, match=r"eos_token_id is 3 but the target's is 2"):
        build(eos)
    start = make_bart(tmp_path / "start", decoder_start_token_id=0, with_tokenizer=False)
    with pytest.raises(ValueError, match=r"decoder_start_token_id is 0 but the target's is 2"):
        build(start)
    with pytest.raises(ValueError, match=r"speculative_config: model='.*missing'"):
        build(tmp_path / "missing")


def test_whisper_draft_encodes_the_audio_itself_after_the_language_slot(tmp_path, target):
    """A Whisper draft for a Whisper target: audio features in, the language slot
    filled by the target first, then the draft proposes (here the target itself:
    accepted where the target's suppress-token processors agree with its raw argmax).
    A token-id draft for an audio target is refused by name."""
    from helpers import make_whisper, synth_audio

    path = make_whisper(tmp_path / "whisper", num_mel_bins=80, seed=80)
    clips = [synth_audio(7.0, seed=11)]
    res = {}
    for draft in (None, path):
        llm = LLM(str(path), dtype="float32", device="cpu", speculative_config=draft and spec(draft))
        res[draft] = llm.transcribe(clips, sampling_rate=16000, use_tqdm=False)
    for a, b in zip(res[None], res[path], strict=True):
        assert (a.language, a.text) == (b.language, b.text)
    assert llm.get_stats()["spec_accepted_tokens"] > 0
    assert_draft_left_nothing(llm)
    with pytest.raises(ValueError, match=r"the draft \(BartForConditionalGeneration\) reads token ids but the "
                                         r"target \(Whisper.*\) reads audio features"):
        LLM(str(path), dtype="float32", device="cpu", speculative_config=spec(target))
