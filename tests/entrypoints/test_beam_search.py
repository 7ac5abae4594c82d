"""Beam search in the engine against HF ``generate``: the returned sequences token
for token and their beam scores to 1e-4, many requests with different settings
in one batch, under preemption, the checkpoint's generation config as the
defaults, and the block accounting of forked beams."""

import random

import pytest

from helpers import hf_search, make_bart
from tandem import LLM, BeamSearchParams, SamplingParams
from tandem.core.kv.block_pool import Device, blocks_for

# Beam scores to 1e-4, relative for large ones: the tiny checkpoints' wide weights give
# logits of O(100), whose float32 rounding (~1e-5 absolute per step, from kernels that
# sum in a different order than HF's) adds up over <= 24 steps and is scaled by
# length ** -length_penalty; observed worst 2.5e-5 relative.
SCORE_REL, SCORE_ABS = 1e-4, 1e-4


def _encoder_prompts(seed: int, n: int, vocab: int = 96) -> list[list[int]]:
    rng = random.Random(seed)
    return [[0] + [rng.randrange(4, vocab) for _ in range(rng.randint(2, 30))] + [2] for _ in range(n)]


def _assert_same(out, ref, n, eos=2):
    assert out.error is None, out.error
    assert len(out.outputs) == n
    for got, (tokens, score) in zip(out.outputs, ref[:n]):
        assert got.token_ids == tokens
        assert got.cumulative_logprob == pytest.approx(score, rel=SCORE_REL, abs=SCORE_ABS)
        assert got.finish_reason == ("stop" if tokens and tokens[-1] == eos else "length")


def _settings(rng: random.Random) -> dict:
    beams = rng.choice([2, 3, 4, 5])
    return dict(
        num_beams=beams,
        length_penalty=rng.choice([1.0, 2.0, 0.5, -0.5]),
        early_stopping=rng.choice([True, False, "never"]),
        max_new_tokens=rng.randint(2, 18),
        num_return_sequences=rng.randint(1, beams),
        no_repeat_ngram_size=rng.choice([0, 0, 2, 3]),
    )


def _params(kw: dict) -> SamplingParams:
    return SamplingParams(
        num_beams=kw["num_beams"], n=kw["num_return_sequences"], length_penalty=kw["length_penalty"],
        early_stopping=kw["early_stopping"], max_tokens=kw["max_new_tokens"],
        no_repeat_ngram_size=kw["no_repeat_ngram_size"],
    )


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.slow
def test_batched_beam_requests_with_different_settings_equal_hf(bart_dir, block_size):
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", block_size=block_size)
    rng = random.Random(block_size)
    prompts = _encoder_prompts(block_size, 16)
    settings = [_settings(rng) for _ in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [_params(kw) for kw in settings], use_tqdm=False)
    for prompt, kw, out in zip(prompts, settings, outs):
        ref = hf_search(bart_dir, prompt, [2, 0], do_sample=False, **kw)
        _assert_same(out, ref, kw["num_return_sequences"])
    # Outputs of different lengths and both finish reasons: the test is not degenerate.
    assert len({len(o.outputs[0].token_ids) for o in outs}) > 3
    assert {o.outputs[0].finish_reason for o in outs} == {"stop", "length"}
    assert llm.get_stats()["kv_blocks_free"] == llm.get_stats()["kv_blocks_total"]


def test_beams_mixed_with_greedy_and_sampled_requests(bart_dir):
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu")
    prompts = _encoder_prompts(7, 6)
    beam = SamplingParams(num_beams=4, n=2, max_tokens=12, length_penalty=1.5)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    sampled = SamplingParams(temperature=0.9, max_tokens=12, seed=3)
    params = [beam, greedy, sampled, beam, greedy, sampled]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    alone = llm.generate([{"prompt_token_ids": p} for p in prompts[2::3]], sampled, use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        if i % 3 == 0:
            _assert_same(out, hf_search(bart_dir, prompt, [2, 0], do_sample=False, num_beams=4,
                                        num_return_sequences=2, max_new_tokens=12, length_penalty=1.5), 2)
        elif i % 3 == 1:
            ref = hf_search(bart_dir, prompt, [2, 0], do_sample=False, max_new_tokens=12)
            assert out.outputs[0].token_ids == ref[0][0]
    # A seeded request samples the same tokens whatever else is in the batch.
    assert [o.outputs[0].token_ids for o in outs[2::3]] == [o.outputs[0].token_ids for o in alone]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.slow
def test_beams_under_preemption_equal_hf(bart_dir, mode):
    # A pool far too small for 8 requests of 4 beams: groups are preempted and resumed.
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=70,
              preemption_mode=mode)
    prompts = _encoder_prompts(11, 8)
    params = SamplingParams(num_beams=4, n=4, max_tokens=20, ignore_eos=True, length_penalty=0.8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref = hf_search(bart_dir, prompt, [2, 0], do_sample=False, num_beams=4, num_return_sequences=4,
                        max_new_tokens=20, length_penalty=0.8, eos_token_id=None)
        _assert_same(out, ref, 4, eos=None)
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0
    if mode == "swap":
        assert stats["swapped_out_blocks"] > 0 and stats["swapped_in_blocks"] == stats["swapped_out_blocks"]
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_beams_hold_no_more_blocks_than_beams_times_their_length(bart_dir):
    """After every step: the distinct self-attention blocks of a beam request are at
    most the blocks of the beams' common prefix plus, per beam, those past it; and
    every block's refcount equals the number of tables holding it."""
    bs = 4
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", block_size=bs)
    engine, bm = llm.llm_engine, llm.llm_engine.block_manager
    prompts = _encoder_prompts(5, 3)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p},
                           SamplingParams(num_beams=5, max_tokens=24, ignore_eos=True))
    shared_seen = False
    while engine.has_unfinished_requests():
        engine.step()
        for group in list(engine.scheduler.running):
            seqs = [s for s in group.seqs if bm.has_block_table(s)]
            if len(seqs) < 2:
                continue
            tables = [bm.get_block_table(s) for s in seqs]
            distinct = {b for t in tables for b in t}
            length = len(seqs[0])
            common = 0
            while all(len(s.token_ids) > common for s in seqs) and len({s.token_ids[common] for s in seqs}) == 1:
                common += 1
            # Tokens computed so far are in the tables; the last one is computed next step.
            computed_common = min(common, min(s.num_computed_tokens for s in seqs))
            shared = computed_common // bs
            bound = shared + len(seqs) * (blocks_for(length, bs) - shared)
            assert len(distinct) <= bound
            assert len(distinct) <= len(seqs) * blocks_for(length, bs)
            shared_seen |= len(distinct) < len(seqs) * len(tables[0])
        counts: dict[int, int] = {}
        for t in bm.tables(Device.DEVICE):
            for b in t:
                counts[b] = counts.get(b, 0) + 1
        for b, c in counts.items():
            assert bm.refcount(Device.DEVICE, b) == c
    assert shared_seen  # forked beams really share blocks
    assert bm.num_free_blocks() == bm.num_total_blocks()


def test_beams_keep_their_sequences_and_the_worker_copies_their_rows(bart_dir):
    """No fork after the first step: a beam request's sequence ids stay the same from its
    second step to its end, and a beam that continues another's hypothesis takes its
    place (``take_over``). After every step: each block's refcount is the number of tables
    holding it; the block each beam writes next is its own (the partly filled one was
    copied when it took a place, so nothing is copied on write: the next step is an
    in-place one); the worker's block table and token history of every beam equal the
    scheduler's, though no beam's table or history is sent whole again. A request aborted
    right after its beams moved leaves nothing behind, on either side."""
    bs = 4
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", block_size=bs)
    engine, bm, sched = llm.llm_engine, llm.llm_engine.block_manager, llm.llm_engine.scheduler
    worker = engine.executor.worker
    prompts = _encoder_prompts(9, 4)
    params = [SamplingParams(num_beams=4, max_tokens=22, ignore_eos=True, no_repeat_ngram_size=2),  # a history
              SamplingParams(num_beams=3, n=2, max_tokens=18, length_penalty=0.5, logprobs=1),
              SamplingParams(num_beams=5, max_tokens=24, ignore_eos=True),
              SamplingParams(num_beams=2, max_tokens=20, early_stopping=True)]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp)

    outs, checked = [], []
    schedule, execute = sched.schedule, worker.execute_model

    def schedule_and_keep():
        outs.append(schedule())
        return outs[-1]

    def execute_and_check(out, sampling=None):
        result = execute(out, sampling)
        # The block manager's tables are as schedule() left them until the update.
        for sg in out.scheduled:
            for ss in sg.seqs:
                seq = next(s for s in sched.groups[sg.request_id].seqs if s.seq_id == ss.seq_id)
                assert worker.runner.tables.get(ss.seq_id) == bm.get_block_table(seq)
                if sg.request_id == "0":
                    assert worker.histories.get(ss.seq_id) == seq.token_ids
                checked.append(ss.seq_id)
        return result

    sched.schedule, worker.execute_model = schedule_and_keep, execute_and_check
    ids: dict[str, set[int]] = {}
    moved = copied_first = 0
    aborted = None
    while engine.has_unfinished_requests():
        engine.step()
        out = outs[-1]
        assert out.blocks_to_copy == []  # beams write into blocks of their own
        moved += len(out.seq_copies)
        copied_first += len(out.blocks_to_copy_first)
        for sg in out.scheduled:
            if len(sg.seqs) > 1:  # past its first step
                assert ids.setdefault(sg.request_id, {ss.seq_id for ss in sg.seqs}) == {ss.seq_id for ss in sg.seqs}
                assert all(not ss.replace_blocks and ss.prefix_token_ids is None for ss in sg.seqs)
        counts: dict[int, int] = {}
        for t in bm.tables(Device.DEVICE):
            for b in t:
                counts[b] = counts.get(b, 0) + 1
        assert all(bm.refcount(Device.DEVICE, b) == c for b, c in counts.items())
        assert len(counts) + bm.num_free_blocks() == bm.num_total_blocks()
        for group in sched.running:
            for seq in group.seqs:
                table, i = bm.get_block_table(seq), seq.num_computed_tokens // bs
                assert i >= len(table) or bm.refcount(Device.DEVICE, table[i]) == 1
        if aborted is None and "2" in ids and sched._seq_copies:
            group = sched.groups["2"]
            aborted = {s.seq_id for s in group.seqs}
            if any(d in aborted for _, d, _, _ in sched._seq_copies):
                engine.abort_request(["2"])
            else:
                aborted = None
    assert moved > 0 and copied_first > 0 and len(ids) == 4 and checked
    assert aborted and not aborted & worker.runner.tables.keys()
    assert bm.num_free_blocks() == bm.num_total_blocks() and not bm.accounting_errors()


def test_beam_search_params_entry_point(bart_dir):
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu")
    prompt = _encoder_prompts(3, 1)[0]
    outs = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=3, max_tokens=10))
    ref = hf_search(bart_dir, prompt, [2, 0], do_sample=False, num_beams=3, num_return_sequences=3, max_new_tokens=10)
    _assert_same(outs[0], ref, 3)
    assert [o.cumulative_logprob for o in outs[0].outputs] == sorted(
        (o.cumulative_logprob for o in outs[0].outputs), reverse=True
    )


def test_beam_logprobs_sum_to_the_unnormalized_score(bart_dir):
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu")
    prompt = _encoder_prompts(4, 1)[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(num_beams=3, n=3, max_tokens=8, logprobs=2,
                                                                   length_penalty=1.0), use_tqdm=False)[0]
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        total = sum(step[t] for step, t in zip(c.logprobs, c.token_ids))
        # length_penalty 1: the score is the summed log-probability over the length.
        assert c.cumulative_logprob == pytest.approx(total / len(c.token_ids), abs=1e-5)
        assert all(len(step) in (2, 3) for step in c.logprobs)


@pytest.fixture(scope="module")
def cnn_dir(tmp_path_factory):
    """A tiny checkpoint with bart-large-cnn's generation settings, lengths scaled down."""
    from transformers import GenerationConfig

    path = make_bart(tmp_path_factory.mktemp("cnn") / "ckpt", seed=4)
    GenerationConfig(
        bos_token_id=0, eos_token_id=2, pad_token_id=1, decoder_start_token_id=2,
        num_beams=4, length_penalty=2.0, early_stopping=True, no_repeat_ngram_size=3,
        min_length=8, max_length=22, forced_bos_token_id=0, forced_eos_token_id=2,
    ).save_pretrained(path)
    return path


@pytest.mark.slow
def test_generate_without_params_uses_the_checkpoint_generation_config(cnn_dir):
    llm = LLM(model=str(cnn_dir), dtype="float32", device="cpu")
    d = llm.get_default_sampling_params()
    assert (d.num_beams, d.length_penalty, d.early_stopping, d.no_repeat_ngram_size) == (4, 2.0, True, 3)
    assert (d.min_length, d.max_length, d.max_tokens, d.temperature) == (8, 22, None, 0.0)
    assert (d.forced_bos_token_id, d.forced_eos_token_id) == (0, (2,))
    prompts = _encoder_prompts(21, 10)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref = hf_search(cnn_dir, prompt, None)  # HF with nothing but the checkpoint's config
        _assert_same(out, ref, 1)
        assert out.prompt_token_ids == [2]
        assert out.outputs[0].token_ids[0] == 0  # the forced BOS
        assert len(out.outputs[0].token_ids) >= 8 - 1  # min_length counts the decoder start
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 5


def test_explicit_fields_override_only_themselves(cnn_dir):
    llm = LLM(model=str(cnn_dir), dtype="float32", device="cpu")
    prompt = _encoder_prompts(22, 1)[0]
    # max_tokens alone: still beam search with the config's other settings (HF: max_new_tokens).
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=9, n=2), use_tqdm=False)[0]
    _assert_same(out, hf_search(cnn_dir, prompt, None, max_new_tokens=9, num_return_sequences=2), 2)
    # An explicit temperature asks for sampling: the config's beams give way.
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.7, seed=1), use_tqdm=False)[0]
    assert out.error is None and len(out.outputs) == 1
    # Greedy by explicit num_beams=1 keeps the config's processors.
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(num_beams=1), use_tqdm=False)[0]
    ref = hf_search(cnn_dir, prompt, None, num_beams=1)
    assert out.outputs[0].token_ids == ref[0][0]
    # A conflict with a default is a per-request error that says where the default came from.
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=6), use_tqdm=False)[0]
    assert out.error is not None and "num_beams" in out.error and "generation_config" in out.error


def test_generation_config_none_uses_sampling_params_defaults(cnn_dir):
    llm = LLM(model=str(cnn_dir), dtype="float32", device="cpu", generation_config="none")
    assert llm.get_default_sampling_params() == SamplingParams()
    with pytest.raises(ValueError, match="generation_config="):
        LLM(model=str(cnn_dir), dtype="float32", device="cpu", generation_config="/no/such/dir")


def test_beam_requests_that_cannot_be_served_are_rejected_alone(bart_dir):
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", max_num_seqs=4)
    outs = llm.generate(
        [{"prompt_token_ids": [0, 5, 2]}] * 3,
        [SamplingParams(num_beams=8, max_tokens=4), SamplingParams(num_beams=2, max_tokens=4),
         SamplingParams(num_beams=2, max_tokens=4, bad_words_ids=[[500]])],
        use_tqdm=False,
    )
    assert "num_beams=8 exceeds max_num_seqs=4" in outs[0].error
    assert outs[1].error is None and len(outs[1].outputs) == 1
    assert "bad_words_ids" in outs[2].error and "500" in outs[2].error
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(num_beams=2, temperature=0.5)
    with pytest.raises(ValueError, match="stop strings"):
        SamplingParams(num_beams=2, stop=["x"])


def test_beam_steps_are_recorded_on_the_steady_path_as_the_general_one_would(bart_dir):
    """Beam groups take the scheduler's steady path (``steady_step_mode``): at every step
    each beam group's record built there equals ``_metadata``'s for it against the
    worker's tables as they were (step mode included), block-opening steps too, and
    the outputs equal HF's."""
    from tandem.core.strategies.beam import BeamStep

    bs = 4
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", block_size=bs)
    sched = llm.llm_engine.scheduler
    steady = sched._steady
    seen = {"records": 0, "opened": 0}

    def steady_and_check(queue):
        before = {sid: list(t) for sid, t in sched._sent_tables.items()}
        got = steady(queue)
        records = got[0]
        after = {sid: list(t) for sid, t in sched._sent_tables.items()}
        for rid, rec in records.items():
            group = sched.groups[rid]
            if not isinstance(rec.mode, BeamStep):
                continue
            sched._sent_tables.update({sid: list(t) for sid, t in before.items()})
            assert rec == sched._metadata(group, False)
            sched._sent_tables.clear()
            sched._sent_tables.update({sid: list(t) for sid, t in after.items()})
            seen["records"] += 1
            seen["opened"] += sum(1 for ss in rec.seqs if ss.block_ids)
        return got

    sched._steady = steady_and_check
    rng = random.Random(11)
    prompts = _encoder_prompts(11, 6)
    settings = [_settings(rng) for _ in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [_params(kw) for kw in settings], use_tqdm=False)
    assert seen["records"] > 20 and seen["opened"] > 0
    for prompt, kw, out in zip(prompts, settings, outs):
        _assert_same(out, hf_search(bart_dir, prompt, [2, 0], do_sample=False, **kw), kw["num_return_sequences"])


@pytest.mark.parametrize("length_penalty", [1.0, 2.0, -0.5])
def test_an_aborted_beam_request_returns_its_best_n_so_far(bart_dir, length_penalty):
    """A beam request aborted after k steps returns its n best candidates so far, by the
    search's own score: its finished hypotheses and its running beams, those scored as
    finished (``sum of log-probs / length ** length_penalty``). That is what HF's search
    cut at k new tokens returns (its last step ends every beam on length): tokens and
    scores as HF's. A hypothesis that ended on EOS keeps ``stop``; a beam cut short ends
    ``abort``, as an aborted sample does. No more than n completions, and no block left."""
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu")
    engine = llm.llm_engine
    prompts = _encoder_prompts(13, 8)
    n, k = 2, 6
    params = SamplingParams(num_beams=4, n=n, max_tokens=20, length_penalty=length_penalty)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    done = set()
    for _ in range(k):
        done |= {o.request_id for o in engine.step() if o.finished}  # the search ended: nothing to abort
    for group in engine.scheduler.running:
        assert {len(s.output_token_ids) for s in group.seqs} == {k}
    outs = engine.abort_request([str(i) for i in range(len(prompts))])
    assert len(outs) + len(done) == len(prompts) and len(outs) >= 4
    reasons = set()
    for out in outs:
        prompt = prompts[int(out.request_id)]
        ref = hf_search(bart_dir, prompt, [2, 0], do_sample=False, num_beams=4, num_return_sequences=n,
                        max_new_tokens=k, length_penalty=length_penalty)
        assert out.finished and out.error is None and len(out.outputs) == n
        for i, (got, (tokens, score)) in enumerate(zip(out.outputs, ref)):
            assert got.index == i and got.token_ids == tokens
            assert got.cumulative_logprob == pytest.approx(score, rel=SCORE_REL, abs=SCORE_ABS)
            assert got.finish_reason == ("stop" if tokens[-1] == 2 else "abort")
            reasons.add(got.finish_reason)
    assert reasons == {"stop", "abort"}  # both kinds of completion are among the best
    bm = engine.block_manager
    assert bm.num_free_blocks() == bm.num_total_blocks()


def test_a_beam_request_aborted_before_its_first_step_returns_one_empty_completion(bart_dir):
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu")
    engine = llm.llm_engine
    engine.add_request("0", {"prompt_token_ids": _encoder_prompts(3, 1)[0]}, SamplingParams(num_beams=4, n=3))
    (out,) = engine.abort_request("0")
    assert out.finished and [(o.token_ids, o.finish_reason) for o in out.outputs] == [([], "abort")]
