"""Shared encoder runs and shared decoder-prompt blocks, end to end against HF.

Requests over one document share one cross table and one encoder run; the
``n`` sequences of a request share their decoder prompt's blocks and copy a
shared block before writing into it. Outputs must still equal HF's greedy
``generate`` token for token (float32), with and without preemption.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from helpers import assert_preempted, hf_greedy
from tandem import LLM, SamplingParams
from tandem.core.kv.block_pool import Device

rng = random.Random(7)
DOC = [0, *(rng.randrange(4, 96) for _ in range(28)), 2]  # 30 encoder tokens
OTHER_DOC = [0, *(rng.randrange(4, 96) for _ in range(17)), 2]


def _prompt(doc: list[int], decoder: list[int]) -> dict:
    return {"encoder_prompt": {"prompt_token_ids": doc}, "decoder_prompt": {"prompt_token_ids": decoder}}


def _decoders(n: int, seed: int) -> list[list[int]]:
    r = random.Random(seed)
    return [[0, *(r.randrange(4, 96) for _ in range(r.randint(0, 6)))] for _ in range(n)]


def _count_encoder_runs(llm, monkeypatch) -> list[int]:
    """Encoder tokens of each encoder forward call."""
    encoder, calls = llm.engine.model.model.encoder, []
    real = encoder.forward

    def counting(input_ids, *args, **kwargs):
        calls.append(int(input_ids.numel()))
        return real(input_ids, *args, **kwargs)

    monkeypatch.setattr(encoder, "forward", counting)
    return calls


def _check_identity(bm) -> None:
    """refcount = tables holding each block; the free ones number num_free_blocks."""
    for dev in Device:
        counts = Counter(b for t in bm.tables(dev) for b in t)
        refs = [bm.refcount(dev, b) for b in range(bm.num_total_blocks(dev))]
        assert refs == [counts[b] for b in range(len(refs))]
        assert refs.count(0) == bm.num_free_blocks(dev)


def _assert_all_free(llm) -> None:
    bm = llm.engine.block_manager
    for dev in Device:
        assert bm.num_free_blocks(dev) == bm.num_total_blocks(dev)
        assert bm.tables(dev) == []


def _check_against_hf(model_dir, outs, max_tokens, min_tokens=0):
    for o in outs:
        assert o.error is None, o.error
        ref = hf_greedy(model_dir, o.encoder_prompt_token_ids, o.prompt_token_ids, max_tokens, min_tokens)
        for c in o.outputs:
            assert c.token_ids == ref, (o.prompt_token_ids, c.index)


@pytest.mark.parametrize("cross_views", [False, True])
def test_eight_requests_over_one_document_run_the_encoder_once(bart_dir, monkeypatch, cross_views):
    # All eight are admitted in one step: seven read the cross table the eighth's
    # encoder fills in that same forward pass (each layer writes before it reads).
    import tandem.backends.torch_sdpa as sdpa

    if cross_views:  # read contiguous cross tables through cache views, not gathers
        monkeypatch.setattr(sdpa, "VIEW_MIN_CROSS_ELEMENTS", 1)
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", block_size=4)
    calls = _count_encoder_runs(llm, monkeypatch)
    prompts = [_prompt(DOC, d) for d in _decoders(8, 0)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    assert calls == [len(DOC)]
    sched = llm.engine.scheduler
    assert (sched.encoder_tokens_computed, sched.encoder_tokens_reused) == (len(DOC), 7 * len(DOC))
    _check_against_hf(bart_dir, outs, 12)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1  # the decoder prompts matter
    _assert_all_free(llm)


def test_a_request_arriving_later_reads_the_live_cross_table(bart_dir, monkeypatch):
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", block_size=4)
    calls = _count_encoder_runs(llm, monkeypatch)
    eng, params = llm.engine, SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10)
    decoders = _decoders(6, 1)
    done = {}
    for i, d in enumerate(decoders[:3]):
        eng.add_request(f"early-{i}", _prompt(DOC, d), params)
    for _ in range(3):
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    for i, d in enumerate(decoders[3:]):
        eng.add_request(f"late-{i}", _prompt(DOC, d), params)
        eng.add_request(f"other-{i}", _prompt(OTHER_DOC, d), params)
    while eng.has_unfinished_requests():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
        _check_identity(eng.block_manager)
    assert calls == [len(DOC), len(OTHER_DOC)]
    assert len(done) == 9
    _check_against_hf(bart_dir, done.values(), 10, 10)
    _assert_all_free(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_shared_encoder_under_preemption_matches_hf(bart_dir, mode):
    # Two documents, four requests each, in a pool that holds far fewer than all
    # of them at full length: groups are preempted while others share their tables.
    prompts = [_prompt(doc, d) for doc in (DOC, OTHER_DOC) for d in _decoders(4, 2)]
    params = SamplingParams(temperature=0.0, max_tokens=30, min_tokens=30)
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=40,
              preemption_mode=mode)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_preempted(llm, mode)
    _check_against_hf(bart_dir, outs, 30, 30)
    _assert_all_free(llm)


@pytest.mark.parametrize("mode", [None, "recompute"])
def test_n_greedy_sequences_share_the_prompt_and_each_equal_hf(bart_dir, mode):
    # Decoder prompts of 5 and 7 tokens leave the last prompt block partly filled
    # (block_size 4): every sequence but the last copies it on its first token.
    prompts = [_prompt(DOC, [2, 0, 17, 33, 41]), _prompt(OTHER_DOC, [2, 0, 5, 9, 60, 61, 62])]
    params = SamplingParams(n=4, temperature=0.0, max_tokens=24, min_tokens=24)
    # Up to 8 + 1 + 4 x 7 and 5 + 1 + 4 x 7 blocks at full length: 40 hold one at a time.
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=40,
              preemption_mode=mode)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.get_stats()["num_preemptions"] > 0  # swaps (n > 1) or recomputes
    for o in outs:
        assert [c.index for c in o.outputs] == [0, 1, 2, 3]
    _check_against_hf(bart_dir, outs, 24, 24)
    _assert_all_free(llm)


def test_n8_over_a_96_token_prompt_fits_a_40_block_pool(bart_dir):
    # Shared prompt blocks count once: cross 1 + 6 shared + 8 x 1 = 15 blocks at
    # full length (8 x 7 + 1 = 57 if every sequence held its own prompt).
    r = random.Random(3)
    decoder = [2, *(r.randrange(4, 96) for _ in range(95))]
    prompt = _prompt([0, 11, 12, 13, 2], decoder)
    params = SamplingParams(n=8, temperature=0.0, max_tokens=16, min_tokens=16)
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", block_size=16, num_kv_blocks=40)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert out.prompt_token_ids == decoder and len(out.outputs) == 8
    assert llm.get_stats()["num_preemptions"] == 0
    _check_against_hf(bart_dir, [out], 16, 16)
    _assert_all_free(llm)


def test_seeded_n_sampling_is_reproducible_and_keeps_the_identities(bart_dir):
    prompts = [_prompt(DOC, [2, 0, 17]), _prompt(DOC, [2, 0, 40, 41, 42])]
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=20, ignore_eos=True)

    def run():
        # Up to 8 + 4 x 6 blocks each, the cross table shared: 36 blocks force swaps.
        llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=36)
        eng, done = llm.engine, {}
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, params)
        while eng.has_unfinished_requests():
            done.update((o.request_id, o) for o in eng.step() if o.finished)
            _check_identity(eng.block_manager)
        _assert_all_free(llm)
        assert eng.get_stats()["swapped_out_blocks"] > 0
        return [[c.token_ids for c in done[str(i)].outputs] for i in range(len(prompts))]

    first = run()
    assert run() == first
    assert all(len({tuple(t) for t in seqs}) > 1 for seqs in first)  # the samples differ
